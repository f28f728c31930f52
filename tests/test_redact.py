"""Redaction (wedgectl.read.redact): secrets by name and by shape go, innocent arguments stay; and where it is applied."""

from __future__ import annotations

import json
import stat
import tarfile
from pathlib import Path

import pytest

from wedgectl.store.bundle import read_bundle, to_jsonable, write_bundle
from wedgectl.model.errors import UnwritableOutput
from wedgectl.read.redact import REDACTED, is_secret_name, redact_argv, redact_env, redact_obj, redact_text, redact_url
from wedgectl.render.text import render_report, render_verdict, verdict_to_json
from wedgectl.model.types import Bundle, Evidence, Manifest, ProcessSample, Role, Sample, Target, Verdict, VerdictKind

SECRETS = ("sk-proj-Zx81Ab", "hf_QwErTyUiOp", "hunter2-pw", "s3cr3tDbPw", "ProxyPw77")


@pytest.mark.parametrize("name", [
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY", "FOO_PASS", "DB_PASSWD", "PGPASSWORD", "MYSQL_PWD",
    "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "DATABASE_URL", "conn_str", "CONNECTION_STRING", "SENTRY_DSN",
    "GITHUB_TOKEN", "SESSION", "session_id", "XDG_SESSION_ID", "COOKIE", "AUTH", "Authorization", "authToken",
    "PRIVATE_KEY", "ssh_private", "JWT", "REQUEST_SIGNATURE", "--api-key", "--hf-token", "--password", "--token",
    "client_secret", "MY_CREDENTIALS", "SLACK_BOT_TOKEN", "api_key_value",
])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "PATH", "HOME", "PORT", "--port", "--max-model-len", "--tokenizer", "--tokenizer-mode", "--max-num-batched-tokens",
    "TOKENIZERS_PARALLELISM", "pass_config", "encoder_cudagraph_token_budgets", "--model", "--served-model-name",
    "--ssl-keyfile", "SSH_AUTH_SOCK", "HTTP_PROXY", "VLLM_USE_V1", "CUDA_VISIBLE_DEVICES", "USER_ID", "keyboard",
    "--enable-auto-tool-choice", "WEDGE_ENGINE_FIXES", "",
])
def test_innocent_names(name):
    assert not is_secret_name(name)


def test_argv_flag_values_go_in_every_spelling():
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/llama-3-8b", "--port", "8000",
            "--api-key", "sk-proj-Zx81Ab", "--hf-token=hf_QwErTyUiOp", "--password", "hunter2-pw",
            "--max-model-len", "4096", "--token", "plainvalue"]
    out = redact_argv(argv)
    assert out == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/llama-3-8b", "--port",
                   "8000", "--api-key", REDACTED, f"--hf-token={REDACTED}", "--password", REDACTED,
                   "--max-model-len", "4096", "--token", REDACTED]


def test_env_style_args_and_a_flag_without_value():
    argv = ["env", "FOO_PASS=s3cr3tDbPw", "DATABASE_URL=postgres://u:p@h/db", "HOME=/root",
            "PROXY=http://alice:ProxyPw77@proxy:3128", "vllm", "serve", "/m", "--api-key", "--port", "8000"]
    out = redact_argv(argv)
    assert out[1] == f"FOO_PASS={REDACTED}" and out[2] == f"DATABASE_URL={REDACTED}" and out[3] == "HOME=/root"
    assert out[4] == f"PROXY=http://{REDACTED}@proxy:3128"
    assert out[-3:] == ["--api-key", "--port", "8000"]  # nothing to hide, and --port's value is not eaten


def test_a_title_in_one_argv_string():
    (out,) = redact_argv(["vllm serve /m --api-key sk-proj-Zx81Ab --port 8000"])
    assert out == f"vllm serve /m --api-key {REDACTED} --port 8000"


@pytest.mark.parametrize("text,gone", [
    ("postgres://dbuser:s3cr3tDbPw@db.internal:5432/app", "s3cr3tDbPw"),
    ("http://alice:ProxyPw77@127.0.0.1:8000/metrics", "ProxyPw77"),
    ("https://ghp_abcdefghijklmnopqrstu@github.com/x", "ghp_abcdefghijklmnopqrstu"),
    ("Authorization: Bearer abcdefghijklmnop", "abcdefghijklmnop"),
    ("curl -H 'Authorization: Basic YWxpY2U6cHc='", "YWxpY2U6cHc="),
    ("key is sk-proj-Zx81Ab9x0", "sk-proj-Zx81Ab9x0"),
    ("hf_QwErTyUiOpAsDf in the log", "hf_QwErTyUiOpAsDf"),
    ("token ghp_0123456789abcdefABCDEF0123", "ghp_0123456789abcdefABCDEF0123"),
    ("AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE"),
    ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl", "eyJhbGciOiJIUzI1NiJ9"),
    ("xoxb-1234-5678-abcdefgh", "xoxb-1234-5678-abcdefgh"),
    ("checksum=0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdef"),
    ("blob=Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4MTIz", "Zm9vYmFyYmF6cXV4"),
    ("non-default args: {'api_key': ['plainsecret1'], 'port': 8000}", "plainsecret1"),
    ('{"FOO_PASS": "two words", "x": 1}', "two words"),
    ("pid 5 is not part of a vLLM deployment (python x.py --password=hunter2-pw --port 1)", "hunter2-pw"),
    ("https://x.io/a?token=abc123&b=1", "abc123"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEabc\n-----END RSA PRIVATE KEY-----", "MIIEabc"),
])
def test_shapes_in_free_text(text, gone):
    out = redact_text(text)
    assert gone not in out and REDACTED in out


@pytest.mark.parametrize("text", [
    "vllm serve /models/Qwen2.5-0.5B --port 8000 --max-model-len 4096 --max-num-batched-tokens 2048",
    "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 12.3 tokens/s, Running: 1 reqs",
    "--model=/home/user/models/llama-3-8b-instruct-awq-xyz",
    "http://127.0.0.1:8000/metrics",
    "listening on 0.0.0.0:8000 (pid 123)",
    "non-default args: {'model_tag': '/m', 'api_key': None, 'pass_config': {'fuse': True}}",
    "12:00:01 INFO engine step 5",
    "",
])
def test_innocent_text_is_untouched(text):
    assert redact_text(text) == text


def test_urls_env_and_trees():
    assert redact_url("http://user:pass@127.0.0.1:8000") == f"http://{REDACTED}@127.0.0.1:8000"
    assert redact_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000" and redact_url(None) is None
    env = {"HF_TOKEN": "hf_QwErTyUiOp", "FOO_PASS": "x", "HOME": "/root", "EMPTY_TOKEN": "",
           "https_proxy": "http://alice:ProxyPw77@proxy:3128"}
    assert redact_env(env) == {"HF_TOKEN": REDACTED, "FOO_PASS": REDACTED, "HOME": "/root", "EMPTY_TOKEN": "",
                               "https_proxy": f"http://{REDACTED}@proxy:3128"}
    tree = {"a": ["--api-key", "k", {"password": "pw", "n": 3, "port": "8000"}], "b": "sk-proj-Zx81Ab9"}
    assert redact_obj(tree) == {"a": ["--api-key", "k", {"password": REDACTED, "n": 3, "port": "8000"}],
                                "b": REDACTED}


def test_redaction_is_idempotent():
    text = "postgres://u:s3cr3tDbPw@h/db --api-key sk-proj-Zx81Ab FOO_PASS=x"
    once = redact_text(text)
    assert redact_text(once) == once


# --- where it is applied: renderers and the bundle writer ------------------------------------------


def _bundle_with_secrets() -> Bundle:
    argv = ("python", "-m", "vllm", "serve", "/m", "--api-key", "sk-proj-Zx81Ab", "--port", "8000")
    proc = ProcessSample(pid=10, ppid=1, role=Role.API_SERVER, name="python", cmdline=argv)
    verdict = Verdict(VerdictKind.INCONCLUSIVE, 0.5, "seen at http://alice:ProxyPw77@127.0.0.1:8000", "r",
                      evidence=(Evidence("log", "DATABASE_URL=postgres://u:s3cr3tDbPw@h/db in the environment",
                                         values={"password": "hunter2-pw", "frames": ["f --token hf_QwErTyUiOp"]}),),
                      advice=("rerun without --password hunter2-pw",))
    return Bundle(
        manifest=Manifest(source="live", target=Target(pid=10, url="http://alice:ProxyPw77@127.0.0.1:8000")),
        samples=(Sample(t=1.0, processes=(proc,)),),
        log_lines=("non-default args: {'api_key': ['sk-proj-Zx81Ab']}", "DB at postgres://u:s3cr3tDbPw@h"),
        verdict=verdict,
    )


def _assert_clean(text: str) -> None:
    for s in SECRETS:
        assert s not in text, s


def test_renderers_redact_text_and_json():
    b = _bundle_with_secrets()
    _assert_clean("\n".join(render_verdict(b.verdict, width=20)))  # a narrow wrap must not split a secret out
    _assert_clean(json.dumps(verdict_to_json(b.verdict, url=b.manifest.target.url)))
    _assert_clean("\n".join(render_report(b.verdict, False, url=b.manifest.target.url,
                                          collector_failures=[{"collector": "c", "kind": "k",
                                                               "message": "GET http://a:ProxyPw77@h failed"}])))


@pytest.mark.parametrize("suffix", ["b.tar.gz", "b"])
def test_bundles_are_written_redacted_and_private(tmp_path, suffix):
    path = write_bundle(_bundle_with_secrets(), tmp_path / suffix)
    if suffix.endswith(".tar.gz"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with tarfile.open(path) as tar:
            members = tar.getmembers()
            assert members and all(stat.S_IMODE(m.mode) == 0o600 for m in members)
            texts = [tar.extractfile(m).read().decode() for m in members]
    else:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        files = list(path.iterdir())
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
        texts = [f.read_text() for f in files]
    for text in texts:
        _assert_clean(text)
    back = read_bundle(path)
    assert back.samples[0].processes[0].cmdline[-4:] == ("--api-key", REDACTED, "--port", "8000")
    assert back.manifest.target.url == f"http://{REDACTED}@127.0.0.1:8000"


def test_an_existing_world_readable_file_is_never_written(tmp_path):
    """Whoever made the file could read what we write into it: it is refused, not narrowed and reused."""
    target = tmp_path / "b.tar.gz"
    target.write_bytes(b"old")
    target.chmod(0o644)
    with pytest.raises(UnwritableOutput, match="already exists"):
        write_bundle(_bundle_with_secrets(), target)
    assert target.read_bytes() == b"old" and stat.S_IMODE(target.stat().st_mode) == 0o644


def test_recorded_bundles_have_nothing_to_redact():
    """The writer's redaction leaves real captures alone: the recorded bundles round-trip unchanged."""
    for path in sorted(Path(__file__).parent.joinpath("fixtures", "bundles").glob("*.tar.gz")):
        b = read_bundle(path)
        assert redact_obj(to_jsonable(b)) == to_jsonable(b), path.name
