"""Text-layer cost per token: detokenize + stop strings + output parsing over concurrent streams.

python -m bench.text [--streams 256] [--tokens 256] [--repeat 3] [--tokenizer DIR]: JSON lines on stdout,
progress on stderr. Needs a real tokenizer directory (default ../shared/fixtures/qwen3-tokenizer).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import subprocess
import sys
import time

from rawserve.text.detokenizer import IncrementalDetokenizer
from rawserve.text.parsers import OutputParser
from rawserve.text.stop import StopChecker
from rawserve.text.tokenizer import WINDOW, Tokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER = ROOT.parent / "shared" / "fixtures" / "qwen3-tokenizer"
TARGET_US_PER_TOKEN = 30.0
STOPS = ("</answer>", "Observation:", "\n\n\n\n")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog, and then it rests for a while. ",
    "Let me think about this step by step: first, 17 * 23 = 391; then add 9 to get 400. ",
    "東京の天気は晴れですが、午後から雨が降るかもしれません。",
    "我们需要先检查输入，然后再计算结果。",
    "Résumé: naïve café owners in Zürich prefer crème brûlée. ",
    "Emoji time 🎉🚀🌧️👩‍💻 and more 😀. ",
    "def area(r: float) -> float:\n    return 3.14159 * r ** 2\n\n", "| col | value |\n|-----|-------|\n| a | 1 |\n",
    "Привет, как дела? Всё хорошо. ", "x < y && y > z; // comparisons with <tags> inside\n",
]


def git_rev() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def stream_text(rng: random.Random, num_chars: int) -> str:
    """A Qwen3-style output: optional reasoning, answer text, sometimes a tool call."""
    parts = []
    if rng.random() < 0.6:
        parts.append("<think>\n" + "".join(rng.choice(SENTENCES) for _ in range(4)) + "\n</think>\n\n")
    while sum(map(len, parts)) < num_chars:
        if rng.random() < 0.1:
            args = {"city": rng.choice(["Paris", "東京", "São Paulo"]), "days": rng.randint(1, 9),
                    "notes": rng.choice(SENTENCES)}
            parts.append("<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": args},
                                                      ensure_ascii=False) + "\n</tool_call>\n")
        else:
            parts.append(rng.choice(SENTENCES))
    return "".join(parts)


def make_streams(tokenizer: Tokenizer, num_streams: int, num_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    streams = []
    for _ in range(num_streams):
        ids: list[int] = []
        while len(ids) < num_tokens:
            ids += tokenizer.encode(stream_text(rng, 6 * num_tokens), add_special_tokens=False)
        streams.append(ids[:num_tokens])
    return streams


def run_pipeline(tokenizer: Tokenizer, streams: list[list[int]], mode: str | None,
                 stages: str) -> tuple[float, dict]:
    """Seconds to push every stream through the stages, one token per stream per step, interleaved
    as the frontend sees them after each engine step; and counts showing the work was real."""
    detoks = [IncrementalDetokenizer(tokenizer, skip_special_tokens=True, mode=mode) for _ in streams]
    stops = [StopChecker(STOPS) for _ in streams]
    parsers = [OutputParser("qwen3", True) for _ in streams]
    num_steps = max(map(len, streams))
    use_stop, use_parse = "stop" in stages, "parse" in stages
    deltas = [0] * len(streams)
    start = time.perf_counter()
    for step in range(num_steps):
        last = step == num_steps - 1
        for k, ids in enumerate(streams):
            text = detoks[k].add(ids[step:step + 1])
            if last:
                text += detoks[k].flush()
            if use_stop:
                text = stops[k].add(text)
                if last:
                    text += stops[k].finish()
            if use_parse:
                deltas[k] += len(parsers[k].feed(text, final=last))
    seconds = time.perf_counter() - start
    counts = {"num_stopped": sum(s.stopped is not None for s in stops),
              "num_with_tool_calls": sum(p.has_tool_calls for p in parsers), "num_deltas": sum(deltas)}
    return seconds, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256, help="concurrent simulated streams")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per configuration (best is reported)")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="checkpoint/tokenizer directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-window", action="store_true", help="skip the window-mode comparison")
    args = parser.parse_args()
    if args.streams < 1 or args.tokens < 2 or args.repeat < 1:
        parser.error("--streams >= 1, --tokens >= 2, --repeat >= 1")

    rev = git_rev()
    load_start = time.perf_counter()
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    tokenizer.vocab_bytes()
    load_s = time.perf_counter() - load_start
    streams = make_streams(tokenizer, args.streams, args.tokens, args.seed)
    num_tokens = sum(map(len, streams))
    print(f"tokenizer {args.tokenizer} ({tokenizer.decode_mode}) loaded in {load_s:.2f}s; "
          f"{args.streams} streams x {args.tokens} tokens", file=sys.stderr)

    warm = streams[: max(1, len(streams) // 8)]
    warmup_s, _ = run_pipeline(tokenizer, warm, None, "detok+stop+parse")
    config = {"bench": "text", "tokenizer": pathlib.Path(args.tokenizer).name, "streams": args.streams,
              "tokens_per_stream": args.tokens, "repeat": args.repeat, "reasoning_parser": "qwen3",
              "tool_parser": "hermes", "num_stop_strings": len(STOPS), "rev": rev}
    print(json.dumps({**config, "stage": "warmup", "tokenizer_load_s": round(load_s, 3),
                      "warmup_s": round(warmup_s, 3), "warmup_tokens": sum(map(len, warm))}))

    configs = [("detok", None), ("detok+stop", None), ("detok+stop+parse", None)]
    if not args.no_window:
        configs.append(("detok+stop+parse", WINDOW))
    results = {}
    for stages, mode in configs:
        runs = [run_pipeline(tokenizer, streams, mode, stages) for _ in range(args.repeat)]
        best = min(seconds for seconds, _ in runs)
        us = best / num_tokens * 1e6
        results[(stages, mode)] = us
        line = {**config, "stage": stages, "detok_mode": mode or tokenizer.decode_mode, "tokens": num_tokens,
                "best_s": round(best, 4), "us_per_token": round(us, 3)}
        if stages == "detok+stop+parse":
            line.update(runs[0][1])
            line["target_us_per_token"] = TARGET_US_PER_TOKEN
            line["meets_target"] = us <= TARGET_US_PER_TOKEN
        print(json.dumps(line))
        print(f"{stages} [{mode or tokenizer.decode_mode}]: {us:.2f} us/token", file=sys.stderr)
    if not args.no_window:
        fast = results[("detok+stop+parse", None)]
        window = results[("detok+stop+parse", WINDOW)]
        print(json.dumps({**config, "stage": "compare", "window_over_bytes_ratio": round(window / fast, 2)}))


if __name__ == "__main__":
    main()
