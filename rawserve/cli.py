"""The `rawserve` command: `serve [MODEL_DIR]` (the default), `generate` (offline, one prompt) and `demo`
(a server on the demo model plus a client that exercises it). Flags -> configs -> logging -> the work.

Strict flags: no prefix matching, and a flag rawserve lacks (say one of vLLM's) is refused by name,
never ignored. Imports nothing heavy at the top: the server process must load no torch.
"""
from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import sys
import time

from rawserve import __version__
from rawserve.config import LOG_LEVELS, EngineConfig, ServerConfig, add_arguments, apply_environment, build_parser, \
    configs_from_args

COMMANDS = ("serve", "generate", "demo")
log = logging.getLogger("rawserve")

USAGE = f"""usage: rawserve [serve] [MODEL_DIR] [flags]     an OpenAI-compatible server (the default command)
       rawserve generate [MODEL_DIR] [flags]    generate from one prompt offline, no server
       rawserve demo [flags]                    a server on the demo model, exercised by a client

`rawserve serve --help` lists the server's flags; each may also be set as RAWSERVE_<FLAG>
(RAWSERVE_API_KEY, RAWSERVE_PORT, ...), the command line winning. rawserve {__version__}."""


def refuse_unknown(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit 2 naming each flag rawserve lacks, with the nearest real one when a name is close."""
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    flags = [arg for arg in extra if arg.startswith("-")]
    if not flags:
        parser.error(f"unexpected argument(s): {' '.join(extra)}")
    notes = []
    for arg in flags:
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        notes.append(f"{name} (did you mean {close[0]}?)" if close else name)
    parser.error(f"rawserve does not support {', '.join(notes)}; `{parser.prog} --help` lists the flags it has. "
                 "Flags are matched whole, never by prefix.")


def parse_strict(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv`, refusing (refuse_unknown) any argument the parser lacks."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        refuse_unknown(parser, extra)
    return args


def parse_with_model(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv`, taking the checkpoint as a positional MODEL_DIR or as --model-dir/--model."""
    parser.add_argument("model", nargs="?", metavar="MODEL_DIR", default=None,
                        help="Checkpoint directory (same as --model-dir).")
    args = parse_strict(parser, argv)
    if args.model is not None:
        flagged = any(a.split("=", 1)[0] in ("--model-dir", "--model") for a in argv)
        if flagged and args.model_dir != args.model:
            parser.error(f"two checkpoints given: {args.model} and --model-dir {args.model_dir}")
        args.model_dir = args.model
    return args


def serve_main(argv: list[str]) -> int:
    parser = build_parser("rawserve serve")
    parser.usage = "rawserve serve [MODEL_DIR] [flags]  (`rawserve serve --help` lists the flags)"
    parser.epilog = "Every flag may also come from the environment as RAWSERVE_<FLAG>; the command line wins."
    args = parse_with_model(parser, argv)
    try:
        engine_config, server_config = configs_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    from rawserve.logs import setup_logging

    setup_logging(server_config.log_level)
    if engine_config.model_dir is None:
        from rawserve.demo_model import apply_demo_defaults, ensure_demo_model

        engine_config.model_dir = str(ensure_demo_model())
        if note := apply_demo_defaults(engine_config, argv):
            log.info("%s", note)
        if server_config.served_model_name is None:
            server_config.served_model_name = "rawserve-demo"
    try:
        return asyncio.run(serve(engine_config, server_config))
    except ValueError as error:  # a bad flag found while loading (a parser name, --max-model-len, ...)
        print(f"rawserve: {error}", file=sys.stderr)
        return 2


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    from rawserve.api.app import OpenAIServer
    from rawserve.errors import EngineDead

    server = OpenAIServer(engine_config, server_config)
    try:
        await server.start()  # logs the startup summary once it listens
    except EngineDead as error:
        log.error("the engine failed to start: %s", error)
        return 1
    except OSError as error:  # the port is taken, a certificate is unreadable
        log.error("cannot listen on %s:%d: %s", server_config.host, server_config.port, error)
        await server.stop()
        return 1
    return await server.serve()


def generate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rawserve generate", allow_abbrev=False,
                                     description="Generate text offline (no server) from one prompt.")
    add_arguments(parser, EngineConfig)
    parser.add_argument("--prompt", default="Once upon a time", help="Prompt text.")
    parser.add_argument("--chat", action="store_true", help="Wrap the prompt as a user message with the chat "
                                                            "template.")
    parser.add_argument("--max-tokens", type=int, default=48, help="Tokens to generate at most.")
    parser.add_argument("--temperature", type=float, default=None,
                        help="Sampling temperature; default: generation_config.json's, else 0 (greedy).")
    parser.add_argument("--sample-seed", type=int, default=None, help="Seed of this request's sampling.")
    parser.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                        help="Log level (load progress is at info).")
    apply_environment(parser, os.environ)
    args = parse_with_model(parser, argv)
    from rawserve.logs import setup_logging

    setup_logging(args.log_level)

    from rawserve.engine.frontend.llm import LLM
    from rawserve.engine.types import SamplingParams
    from rawserve.text.defaults import GenerationDefaults

    engine_options = {name: getattr(args, name) for name in EngineConfig.__dataclass_fields__ if name != "model_dir"}
    try:
        llm = LLM(args.model_dir, **engine_options)
    except ValueError as error:
        parser.error(str(error))
    defaults = GenerationDefaults.from_dir(llm.model_dir, llm.tokenizer)  # the tokenizer: harmony's stop ids
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


def demo_main(argv: list[str]) -> int:
    from rawserve.demo import build_demo_parser, run_demo

    parser = build_demo_parser()
    args = parse_strict(parser, argv)
    if args.requests < 1 or args.new_tokens < 1:
        parser.error("--requests and --new-tokens must be >= 1")
    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        print()
        build_parser("rawserve serve").print_help()
        return 0
    if argv and argv[0] in ("-V", "--version"):
        print(f"rawserve {__version__}")
        return 0
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "serve"
    if command == "generate":
        return generate_main(argv)
    if command == "demo":
        return demo_main(argv)
    return serve_main(argv)
