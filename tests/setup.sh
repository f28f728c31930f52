#!/usr/bin/env bash
# Set up what the test suite needs beyond `pip install -e '.[test]'`: the host tools the
# integration tests drive (from Debian, as root) and the managed vLLM runtime.
#
# Usage: tests/setup.sh [PYTHON]     (PYTHON: the test venv's python, default .venv/bin/python)
#
# Idempotent and quick when everything is there: a tool already on PATH is not looked up again,
# and `apt-get update` runs only when something is to be installed. Where it cannot install a
# thing (not root, no apt-get, a failed install) it prints one line saying so and carries on:
# the tests that need it then skip, each saying why, and a strict run (WEDGECTL_STRICT_SKIPS=1, as
# .ci/run and the README's test command set it) fails on those skips: only the host-dependent ones
# in tests/skips.toml are allowed. It exits 0 unless the runtime install fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-.venv/bin/python}"

# command on PATH (or py:module for the system python3), the Debian package that provides it,
# and what the tests do without it.
NEEDS=(
  "prometheus prometheus the tests against a real Prometheus skip (tests/integration/test_watch_prometheus.py)"
  "promtool prometheus the alert rules' promtool checks skip (tests/test_watch_deploy.py)"
  "bpftrace bpftrace the eBPF probe tests skip (tests/integration/test_probes*.py)"
  "py:bcc python3-bpfcc the probes' bcc back-end is not tried (bpftrace still is)"
  "tmux tmux top's live tests skip (tests/integration/test_top_live.py)"
  "setpriv util-linux the no-CAP_SYS_PTRACE tests skip or fail"
  "openssl openssl the TLS tests of watch's --web-config-file skip (tests/test_security_exposure.py)"
)

have() {
  case "$1" in
    py:*) /usr/bin/python3 -c "import ${1#py:}" >/dev/null 2>&1 ;;
    *) command -v "$1" >/dev/null 2>&1 ;;
  esac
}

missing=()
for entry in "${NEEDS[@]}"; do
  read -r tool pkg why <<<"$entry"
  have "$tool" || missing+=("$tool|$pkg|$why")
done

if ((${#missing[@]})); then
  cannot=""
  if [[ $(id -u) -ne 0 ]]; then
    cannot="not root"
  elif ! command -v apt-get >/dev/null 2>&1; then
    cannot="no apt-get on this host"
  fi
  if [[ -z $cannot ]]; then
    pkgs=()
    for m in "${missing[@]}"; do IFS='|' read -r _ pkg _ <<<"$m"; pkgs+=("$pkg"); done
    echo "tests/setup.sh: installing ${pkgs[*]} (Debian)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null; }; then
      cannot="apt-get install failed"
    fi
  fi
  for m in "${missing[@]}"; do
    IFS='|' read -r tool pkg why <<<"$m"
    if ! have "$tool"; then
      echo "tests/setup.sh: cannot install $pkg (${cannot:-installed, but no $tool}): $why"
      [[ $tool == py:* ]] || unmet=1  # without bcc nothing skips: bpftrace is tried instead
    fi
  done
  if [[ -n ${unmet:-} ]]; then
    echo "tests/setup.sh: a strict run (WEDGECTL_STRICT_SKIPS=1) fails on those skips (tests/skips.toml)"
  fi
fi

# The managed vLLM runtimes (the default 0.32.0, ~3.4 GB, and 0.19.1, seed 002's series, ~7 GB with the
# standard torch build it needs; minutes each the first time): up front, so no test pays for them inside its
# timeout. `runtime path` answers at once when one is already installed.
OLDER_VLLM=0.19.1  # tests/integration/test_versions_live.py
if [[ -n ${WEDGECTL_VLLM_PYTHON:-} || -n ${WEDGECTL_NO_INSTALL:-} ]]; then
  :  # the tests use that vLLM environment, or skip the vLLM tests: nothing to install
elif [[ ! -x $PYTHON ]]; then
  echo "tests/setup.sh: no $PYTHON; skipped: the vLLM runtime (pip install -e '.[test]' first)"
else
  if ! "$PYTHON" -m wedgectl runtime path >/dev/null 2>&1; then
    "$PYTHON" -m wedgectl runtime install || exit 1
  fi
  if ! "$PYTHON" -m wedgectl runtime path --vllm "$OLDER_VLLM" >/dev/null 2>&1; then
    "$PYTHON" -m wedgectl runtime install --vllm "$OLDER_VLLM" || exit 1
  fi
fi
exit 0
