"""The `rawserve` command: strict flags with vLLM's names, RAWSERVE_<FLAG> from the environment, and real
servers started by the console script and both `python -m rawserve` forms, read back from their stderr."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from rawserve.cli import main, parse_with_model
from rawserve.config import build_parser, configs_from_args
from tests.spawned import listening_port

ROOT = pathlib.Path(__file__).resolve().parent.parent


def parse(argv: list[str], environ: dict | None = None):
    parser = build_parser(environ=environ or {})
    return configs_from_args(parse_with_model(parser, argv))


@pytest.fixture(scope="module")
def demo_dir():
    from rawserve.demo_model import ensure_demo_model

    return ensure_demo_model()


# ---- flags ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, named", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--mod", "x"], "--mod"),  # a prefix of --model / --model-dir: refused, not guessed
    (["--max-model", "5"], "--max-model"),
    (["--enable-log-request"], "--enable-log-request (did you mean --enable-log-requests?)"),
])
def test_unknown_and_prefix_flags_are_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"rawserve does not support {named}" in err and "never by prefix" in err


def test_model_may_be_positional_or_model_or_model_dir():
    assert parse(["ckpt"])[0].model_dir == "ckpt"
    assert parse(["--model", "ckpt"])[0].model_dir == "ckpt"
    assert parse(["--model-dir", "ckpt"])[0].model_dir == "ckpt"
    assert parse(["ckpt", "--port", "0"])[1].port == 0
    with pytest.raises(SystemExit):
        parse(["a", "--model-dir", "b"])


def test_vllm_flag_names_carry_over():
    engine, server = parse(["m", "--dtype", "half", "--gpu-memory-utilization", "0.8", "--shutdown-timeout", "7",
                            "--disable-log-requests", "--uvicorn-log-level", "debug", "--enable-auto-tool-choice",
                            "--generation-config", "vllm", "--tool-call-parser", "hermes"])
    assert (engine.dtype, engine.gpu_memory_utilization) == ("float16", 0.8)
    assert (server.drain_timeout_s, server.log_requests, server.log_level) == (7.0, False, "debug")
    assert (server.enable_auto_tool_choice, server.generation_config) == (True, "vllm")
    assert parse(["--dtype", "float"])[0].dtype == "float32"
    assert parse(["--enable-log-requests"])[1].log_requests is True
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        parse(["--gpu-memory-utilization", "1.5"])
    with pytest.raises(ValueError, match="--ssl-certfile"):
        parse(["--ssl-keyfile", "k.pem"])


def test_environment_sets_every_flag_and_the_command_line_wins():
    env = {"RAWSERVE_API_KEY": "a, b", "RAWSERVE_PORT": "0", "RAWSERVE_LOG_REQUESTS": "false",
           "RAWSERVE_DTYPE": "bfloat16", "RAWSERVE_MODEL_DIR": "/ckpt", "RAWSERVE_ENABLE_PREFIX_CACHING": "0"}
    engine, server = parse([], env)
    assert (server.api_key, server.port, server.log_requests) == (["a", "b"], 0, False)
    assert (engine.dtype, engine.model_dir, engine.enable_prefix_caching) == ("bfloat16", "/ckpt", False)
    engine, server = parse(["other", "--port", "9", "--api-key", "c", "--log-requests"], env)
    assert (engine.model_dir, server.port, server.api_key, server.log_requests) == ("other", 9, ["c"], True)


@pytest.mark.parametrize("name, value", [("RAWSERVE_PORT", "eighty"), ("RAWSERVE_DTYPE", "int3"),
                                         ("RAWSERVE_LOG_REQUESTS", "maybe")])
def test_a_bad_environment_value_names_its_variable(name, value, capsys):
    with pytest.raises(SystemExit):
        build_parser(environ={name: value})
    assert f"{name}={value!r}" in capsys.readouterr().err


def test_generation_config_auto_vllm_or_a_directory(demo_dir, tmp_path):
    from rawserve.api.app import generation_defaults
    from rawserve.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(demo_dir)
    own = generation_defaults(demo_dir, tok, "auto")
    assert own.temperature == 0.7 and own.eos_token_ids
    neutral = generation_defaults(demo_dir, tok, "vllm")
    assert neutral.temperature is None and neutral.eos_token_ids == own.eos_token_ids
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "eos_token_id": 5}))
    other = generation_defaults(demo_dir, tok, str(tmp_path))
    assert other.temperature == 0.2 and other.eos_token_ids == own.eos_token_ids  # EOS stays the checkpoint's


def test_lazy_top_level_names_load_no_torch_until_used():
    code = ("import sys, rawserve; from rawserve import SamplingParams; assert 'torch' not in sys.modules; "
            "from rawserve import LLM; print(SamplingParams.__name__, LLM.__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["SamplingParams", "LLM", "False"]  # torch loads when an LLM is built


# ---- real servers ---------------------------------------------------------------------------------

def console_script() -> str:
    path = shutil.which("rawserve") or str(pathlib.Path(sys.executable).with_name("rawserve"))
    if not os.path.exists(path):
        pytest.skip("the `rawserve` console script is not installed (pip install -e .)")
    return path


class Server:
    """A server subprocess; `lines` is its stderr so far, read until the startup summary names the port."""

    def __init__(self, command: list[str], env: dict | None = None) -> None:
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     cwd=ROOT, env={**{k: v for k, v in os.environ.items()
                                                       if not k.startswith("RAWSERVE_")}, **(env or {})})
        self.lines: list[str] = []
        self.port = listening_port(self.proc, self.lines)

    def stop(self) -> str:
        """SIGTERM, wait for the drain, and return everything it wrote to stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rest = self.proc.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rest = self.proc.communicate()[1]
        return "".join(self.lines) + rest

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def get(port: int, path: str, key: str | None = None) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     headers={"authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


SMALL = ["--num-kv-blocks", "64", "--max-model-len", "512"]


def test_python_m_rawserve_serve_takes_env_vars_and_disable_log_requests(demo_dir):
    env = {"RAWSERVE_API_KEY": "sekrit", "RAWSERVE_ENGINE_MODE": "thread", "RAWSERVE_MODEL_DIR": str(demo_dir)}
    with Server([sys.executable, "-m", "rawserve", "serve", "--port", "0", "--disable-log-requests", *SMALL],
                env) as server:
        assert get(server.port, "/v1/models") == 401
        assert get(server.port, "/v1/models", "sekrit") == 200
    log = server.stop()
    assert "API key on" in log and "engine in a thread" in log
    assert "rawserve.access" not in log


def test_front_process_of_a_process_mode_server_has_no_torch(demo_dir):
    """The real front: OpenAIServer started, a request served, and torch never imported in this process."""
    code = f"""
import asyncio, json, sys, urllib.request
from rawserve.api.app import OpenAIServer
from rawserve.config import EngineConfig, ServerConfig

async def main():
    server = OpenAIServer(EngineConfig(model_dir={str(demo_dir)!r}, num_kv_blocks=32, max_model_len=256),
                          ServerConfig(port=0, engine_mode="process"))
    await server.start()
    def ask():
        req = urllib.request.Request(f"http://127.0.0.1:{{server.port}}/v1/completions",
                                     data=b'{{"prompt": "Hi", "max_tokens": 2}}',
                                     headers={{"content-type": "application/json"}})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())["usage"]["completion_tokens"]
    tokens = await asyncio.to_thread(ask)
    await server.stop()
    print(tokens, "torch" in sys.modules)

asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "False"], out.stderr


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:  # field 4, ppid, after the parenthesised name
            found.append(int(entry))
    return found


def test_console_script_serves_with_a_process_core_logs_and_maps_no_torch_in_the_front(demo_dir, numpy_absent_env):
    """The README's first command, `rawserve serve` with no checkpoint (the demo model cached), on a base install
    (no numpy), its core in a process: it serves and logs its startup summary and access lines; the console
    script's process serves without mapping libtorch (its core process does), and neither process warns on the
    way up."""
    with Server([console_script(), "serve", "--port", "0", "--engine-mode", "process", *SMALL],
                numpy_absent_env) as server:
        assert get(server.port, "/v1/models") == 200
        if os.path.exists("/proc/self/maps"):  # (elsewhere the rest still holds)
            assert "libtorch" not in _maps(server.proc.pid)
            cores = _children(server.proc.pid)
            assert cores and any("libtorch" in _maps(pid) for pid in cores), cores  # the check can see torch
        r = post(server.port, "/v1/completions", {"prompt": "Once upon", "max_tokens": 3})
        assert r["usage"]["completion_tokens"] == 3
        assert get(server.port, "/v1/models/nope") == 404
    log = server.stop()
    assert server.proc.returncode == 0 and "serving 'rawserve-demo'" in log, log
    assert "Failed to initialize NumPy" not in log, log
    assert not [line for line in log.splitlines() if " WARNING " in line or "Warning:" in line], log
    summary = next(line for line in log.splitlines() if "listening on http://127.0.0.1:" in line and "serving" in line)
    for part in ("Qwen3ForCausalLM", "parameters", "dtype float32", "device cpu", "max_model_len 512",
                 "KV cache 1024 tokens (64 blocks of 16, 2.0 MiB, float32) [--num-kv-blocks]", "engine in a process",
                 "API key off"):
        assert part in summary, (part, summary)
    # The spawned core logs too (its model line), in the same format, under its own process name.
    assert re.search(r" INFO rawserve-core rawserve\.engine: model .* on cpu", log), log
    # It sized its threads from the CPUs it may use (--num-threads auto) and says so, as does the summary.
    assert re.search(r"rawserve-core rawserve\.engine\.core: engine threads: \d+ \((auto: |OMP_NUM_THREADS)", log), log
    assert re.search(r"\d+ engine threads \[(auto|OMP_NUM_THREADS)", summary), summary
    access = [line for line in log.splitlines() if "rawserve.access" in line and "/v1/completions" in line]
    assert len(access) == 1, log
    assert re.search(r'127\.0\.0\.1:\d+ "POST /v1/completions" 200 prompt_tokens=\d+ output_tokens=3 ttft_ms=[\d.]+ '
                     r'total_ms=[\d.]+ finish=length rid=cmpl-', access[0]), access[0]
    assert re.search(r'"GET /v1/models/nope" 404', log)


def test_a_taken_port_fails_fast_on_the_default_path(demo_dir):
    """No torch import stands before the bind: the command fails in well under a second (2 s with one)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = ("import sys; from rawserve.cli import main; "
                f"status = main(['serve', '--port', '{port}']); print(status, 'torch' in sys.modules)")
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                             env={k: v for k, v in os.environ.items() if not k.startswith("RAWSERVE_")})
        elapsed_s = time.monotonic() - start
    assert out.stdout.split() == ["1", "False"], out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert elapsed_s < 5, elapsed_s  # generous for a busy 2-core box; torch's import is what the line above rules out


def _self_signed(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        pytest.skip("the cryptography package is needed to make a test certificate")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_with_a_self_signed_certificate_serves_the_openai_sdk_and_drains_on_sigterm(demo_dir, tmp_path):
    """`python -m rawserve --model-dir` (no subcommand; its core in a process, the default) over TLS, to the openai
    SDK; on SIGTERM it drains and exits 0."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    cert, key = _self_signed(tmp_path)
    with Server([sys.executable, "-m", "rawserve", "--model-dir", str(demo_dir), "--port", "0",
                 "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), *SMALL]) as server:
        assert any(f"listening on https://127.0.0.1:{server.port}/v1" in line for line in server.lines)
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as http_client:
            client = openai.OpenAI(base_url=f"https://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0,
                                   http_client=http_client)
            r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=3,
                                               messages=[{"role": "user", "content": "Hi"}])
            assert r.usage.completion_tokens == 3
            chunks = list(client.completions.create(model=r.model, prompt="Hi", max_tokens=3, stream=True))
            assert chunks and chunks[-1].choices[0].finish_reason == "length"
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to a TLS port gets no answer
            get(server.port, "/health")
    log = server.stop()  # SIGTERM: it drains and exits
    assert server.proc.returncode == 0, log
    assert "engine in a process" in log, log
