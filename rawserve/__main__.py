"""python -m rawserve: flags -> configs -> engine, then the OpenAI server. `generate` runs offline.

Without --model-dir the built-in demo model is used (built locally on first use, then cached).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from rawserve.config import EngineConfig, ServerConfig, add_arguments, build_parser, configs_from_args


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

    from rawserve.engine.frontend.llm import LLM
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


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    from rawserve.api.app import OpenAIServer
    from rawserve.errors import EngineDead

    server = OpenAIServer(engine_config, server_config)
    try:
        await server.start()
    except EngineDead as error:
        print(f"rawserve: the engine failed to start: {error}", file=sys.stderr)
        return 1
    print(f"rawserve: serving {server.model_name!r} on http://{server_config.host}:{server.port}/v1 "
          f"(engine in a {server_config.engine_mode}; Ctrl-C to stop)", file=sys.stderr, flush=True)
    return await server.serve()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "generate":
        return generate_main(argv[1:])
    parser = build_parser()
    parser.epilog = "Subcommand: `generate` runs the engine offline on one prompt (see `generate --help`)."
    args = parser.parse_args(argv)
    try:
        engine_config, server_config = configs_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if engine_config.model_dir is None:
        from rawserve.demo_model import ensure_demo_model

        engine_config.model_dir = str(ensure_demo_model())
        if server_config.served_model_name is None:
            server_config.served_model_name = "rawserve-demo"
    try:
        return asyncio.run(serve(engine_config, server_config))
    except ValueError as error:  # a bad flag found while loading (a parser name, --max-model-len, ...)
        print(f"rawserve: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
