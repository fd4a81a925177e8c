"""python -m rawserve: flags -> configs -> engine. `generate` runs the engine offline on one prompt.

Without --model-dir the built-in demo model is used (built locally on first use, then cached).
"""
from __future__ import annotations

import argparse
import sys
import time

from rawserve.config import EngineConfig, add_arguments, build_parser


def generate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rawserve generate",
                                     description="Generate text offline (no server) from one prompt.")
    add_arguments(parser, EngineConfig)
    parser.add_argument("--prompt", default="Once upon a time", help="Prompt text.")
    parser.add_argument("--chat", action="store_true", help="Wrap the prompt as a user message with the chat "
                                                            "template.")
    parser.add_argument("--max-tokens", type=int, default=48, help="Tokens to generate at most.")
    parser.add_argument("--temperature", type=float, default=None,
                        help="Sampling temperature; default: generation_config.json's, else 0 (greedy).")
    parser.add_argument("--sample-seed", type=int, default=None, help="Seed of this request's sampling.")
    args = parser.parse_args(argv)

    from rawserve.engine.llm import LLM
    from rawserve.engine.types import SamplingParams
    from rawserve.text.defaults import GenerationDefaults

    engine_options = {name: getattr(args, name) for name in EngineConfig.__dataclass_fields__ if name != "model_dir"}
    llm = LLM(args.model_dir, **engine_options)
    defaults = GenerationDefaults.from_dir(llm.model_dir)
    prompt = args.prompt
    if args.chat:
        from rawserve.text.chat_template import load_chat_template, render_chat

        template = load_chat_template(llm.model_dir)
        if template is None:
            parser.error(f"--chat: {llm.model_dir} has no chat template")
        tok = llm.tokenizer
        prompt = render_chat(template, [{"role": "user", "content": prompt}], bos_token=tok.bos_token or "",
                             eos_token=tok.eos_token or "")
    temperature = args.temperature if args.temperature is not None else (defaults.temperature or 0.0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=args.sample_seed,
                            top_p=defaults.top_p or 1.0, top_k=defaults.top_k or 0,
                            stop_token_ids=defaults.eos_token_ids)
    t0 = time.perf_counter()
    result = llm.generate(prompt, params)[0]
    seconds = time.perf_counter() - t0
    out = result.outputs[0]
    print(f"{args.prompt}{out.text}")
    print(f"[{len(out.token_ids)} tokens in {seconds:.2f} s, finish_reason={out.finish_reason}, "
          f"model={llm.model_dir}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "generate":
        return generate_main(argv[1:])
    parser = build_parser()
    parser.epilog = "Subcommands: `generate` runs the engine offline on one prompt (see `generate --help`)."
    parser.parse_args(argv)
    parser.error("the HTTP server arrives with the OpenAI API layer; use `python -m rawserve generate` for now")
    return 2


if __name__ == "__main__":
    sys.exit(main())
