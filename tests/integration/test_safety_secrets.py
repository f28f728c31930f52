"""Secrets in a real vLLM server's argv, environment and URL never leave wedgectl, whatever the output.

One tiny-model server of our own (the shared one has no secrets) started with
``--api-key`` and an environment holding DATABASE_URL, HF_TOKEN, FOO_PASS and
a proxy URL with a password; then every way wedgectl shows what it saw:
``diagnose --pid`` as JSON and text, its ``--save-bundle`` (every file, and
their modes), ``diagnose --url`` with user:password in it, the ``top`` picker
and its headless model and saved bundle, the "not part of a vLLM deployment"
error quoting another process's command line, and ``swap --dry-run --json``.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from wedgectl.read.redact import REDACTED
from wedgectl.lab.runtime import Server, ServerSpec, free_port, running_server

pytestmark = pytest.mark.integration

API_KEY = "sk-wedgetest-ApiKeySecret1"
DB_PW = "DbPw-Zq7x91a"
HF_TOKEN = "hf_WedgeTestTok3nXYZ"
FOO_PASS = "FooPass-K2m8b"
PROXY_PW = "ProxyPw-R5t3c"
URL_PW = "UrlPw-W4v6d"
NOT_VLLM_PW = "NotVllmPw-J8e2"
SECRETS = (API_KEY, DB_PW, HF_TOKEN, FOO_PASS, PROXY_PW, URL_PW, NOT_VLLM_PW)
SECRET_ENV = {
    "DATABASE_URL": f"postgres://appuser:{DB_PW}@db.internal:5432/app",
    "HF_TOKEN": HF_TOKEN,
    "FOO_PASS": FOO_PASS,
    "HTTPS_PROXY": f"http://proxyuser:{PROXY_PW}@127.0.0.1:9/",
    "NO_PROXY": "127.0.0.1,localhost",
}


def wedgectl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wedgectl", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_no_secret(text: str, where: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{where} holds {leaked}"


def bundle_texts(path: Path) -> dict[str, str]:
    """Every file of a bundle (directory or .tar.gz), checking each is private."""
    out = {}
    if path.is_dir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        for f in path.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
            out[f.name] = f.read_text(errors="replace")
    else:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                assert stat.S_IMODE(m.mode) == 0o600, m.name
                out[m.name] = tar.extractfile(m).read().decode(errors="replace")
    assert out, path
    return out


@pytest.fixture(scope="module")
def secret_server(vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("secret-vllm") / "server.log"
    spec = ServerSpec(model=tiny_model, port=free_port(), extra_args=("--api-key", API_KEY), env=SECRET_ENV)
    with running_server(spec, vllm_python, log) as server:
        yield server


def test_diagnose_json_text_and_saved_bundles(secret_server: Server, tmp_path: Path) -> None:
    pid = secret_server.pid
    r = wedgectl("diagnose", "--pid", str(pid), "--json", "--window", "2", "--ebpf", "off",
                 "--save-bundle", str(tmp_path / "b.tar.gz"))
    assert r.returncode in (0, 15), r.stderr
    assert_no_secret(r.stdout + r.stderr, "diagnose --json")
    assert json.loads(r.stdout)["verdict"]
    files = bundle_texts(tmp_path / "b.tar.gz")
    for name, text in files.items():
        assert_no_secret(text, f"bundle member {name}")
    samples = next(t for n, t in files.items() if n.endswith("samples.jsonl"))
    assert f'"--api-key", "{REDACTED}"' in samples  # the command line was captured, the key replaced
    log = next(t for n, t in files.items() if n.endswith("log.txt"))
    assert "non-default args" in log  # the server log was captured too

    r = wedgectl("diagnose", "--pid", str(pid), "--window", "2", "--ebpf", "off", "--save-bundle", str(tmp_path / "d"))
    assert r.returncode in (0, 15), r.stderr
    assert "VERDICT" in r.stdout
    assert_no_secret(r.stdout + r.stderr, "diagnose text")
    for name, text in bundle_texts(tmp_path / "d").items():
        assert_no_secret(text, f"bundle file {name}")


def test_url_credentials_are_used_but_never_shown(secret_server: Server, tmp_path: Path) -> None:
    url = secret_server.url.replace("http://", f"http://urluser:{URL_PW}@")
    r = wedgectl("diagnose", "--url", url, "--json", "--window", "2", "--save-bundle", str(tmp_path / "u.tar.gz"))
    assert r.returncode in (0, 15), r.stderr
    out = json.loads(r.stdout)
    assert out["url"].startswith(f"http://{REDACTED}@127.0.0.1:")
    assert_no_secret(r.stdout + r.stderr, "diagnose --url")
    for name, text in bundle_texts(tmp_path / "u.tar.gz").items():
        assert_no_secret(text, f"bundle member {name}")


def test_top_picker_model_and_saved_bundle(secret_server: Server, tmp_path: Path) -> None:
    from wedgectl.tui.source import Collector, LiveSource, find_servers, save_bundle

    servers = [s for s in find_servers() if s.pid == secret_server.pid]
    assert servers, "the picker did not list the server"
    assert f"--api-key {REDACTED}" in servers[0].cmdline
    assert_no_secret(repr(find_servers()), "top picker")

    source = LiveSource.connect(pid=secret_server.pid)
    collector = Collector(source, stacks_every=1)
    frames = [collector.tick() for _ in range(2)]
    assert frames[-1] is not None
    assert_no_secret(repr(frames) + source.label, "top frames")
    saved = save_bundle(collector.bundle(), tmp_path)
    for name, text in bundle_texts(saved).items():
        assert_no_secret(text, f"top bundle member {name}")


def test_the_not_vllm_error_quotes_no_secret(tmp_path: Path) -> None:
    # exec -a: argv[0] carries the secrets, short enough that the 60-character quote would include them
    title = f"w --api-key {NOT_VLLM_PW} DATABASE_URL=postgres://u:{DB_PW}@h"
    proc = subprocess.Popen(["bash", "-c", f'exec -a "{title}" sleep 120'])
    try:
        deadline = time.monotonic() + 5
        while Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0].decode() != title:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = wedgectl("diagnose", "--pid", str(proc.pid), timeout=30)
        assert r.returncode == 31, r.stderr
        assert "not part of a vLLM deployment" in r.stderr and "--api-key" in r.stderr
        assert_no_secret(r.stdout + r.stderr, "the not-vLLM error")
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_swap_dry_run_json_redacts_argv_and_environment(secret_server: Server) -> None:
    r = wedgectl("swap", "--pid", str(secret_server.pid), "--dry-run", "--json", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_no_secret(r.stdout + r.stderr, "swap --dry-run --json")
    plan = json.loads(r.stdout)
    plan = plan.get("plan", plan)
    env = plan["env"]
    assert env["DATABASE_URL"] == env["FOO_PASS"] == env["HF_TOKEN"] == REDACTED
    assert env["HTTPS_PROXY"] == f"http://{REDACTED}@127.0.0.1:9/"
    assert REDACTED in plan["argv"]
    r = wedgectl("swap", "--pid", str(secret_server.pid), "--dry-run", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_no_secret(r.stdout + r.stderr, "swap --dry-run")
    assert httpx.get(f"{secret_server.url}/health", timeout=5).status_code == 200  # nothing was touched
