"""Redaction of secrets in everything that leaves wedgectl: argv, environments, URLs, free text, JSON trees.

The rule (docs/bundle.md, "What a bundle may contain, and what is redacted"):

- By name. A name (an environment variable, a flag such as ``--api-key``, a
  JSON key, ``name=value`` or ``name: value`` in text) is split into parts at
  ``_ - . :`` and at camelCase humps, compared without case. It is secret when
  its last part is in ``SECRET_PARTS`` (``HF_TOKEN``, ``FOO_PASS``,
  ``--api-key``), when its last two parts form a phrase in ``SECRET_PHRASES``
  (``conn_str``, ``database_url``), when its last part only qualifies a secret
  one (``XDG_SESSION_ID``, ``API_KEY_VALUE``), or when any part contains one of
  ``SECRET_STEMS`` (``PGPASSWORD``, ``AWS_SECRET_ACCESS_KEY``). Parts, and the
  last one, not substrings, so that ``--tokenizer``, ``--max-num-batched-tokens``,
  ``pass_config`` and ``token_budgets`` are left alone. The plain path variables
  in ``PLAIN_NAMES`` (``PWD``, ``OLDPWD``, ``XDG_CONFIG_HOME``, ...) are never secret.
- By value shape, wherever it appears: URLs with a user (``scheme://user:pw@``),
  ``Bearer``/``Basic`` credentials, ``sk-``, ``hf_``, ``ghp_``-style, Slack and
  AWS access keys, JWT-like tokens, PEM private keys, and long hex or
  base64 runs after ``=``.

A redacted value becomes ``<redacted>``; the name stays, so a reader can see
that a secret was there. Everything here is pure and total: any string in,
a string out.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, overload

REDACTED = "<redacted>"

# A name part that marks a secret on its own.
SECRET_PARTS = frozenset({
    "key", "apikey", "token", "secret", "pass", "passwd", "password", "passphrase", "pwd", "pw",
    "credential", "credentials", "creds", "auth", "authorization", "dsn", "connstr",
    "connectionstring", "databaseurl", "dburl", "private", "privatekey", "cookie", "cookies", "session",
    "sessionid", "signature", "sig", "bearer", "jwt", "otp", "salt", "sas",
})
# Two neighbouring parts that together mark a secret (each alone does not).
SECRET_PHRASES = frozenset({
    ("connection", "string"), ("conn", "str"), ("conn", "string"), ("database", "url"), ("db", "url"),
    ("db", "uri"), ("database", "uri"), ("access", "id"), ("proxy", "url"),
})
# A part that contains one of these is a secret name even glued to other words ("MYPASSWORD").
SECRET_STEMS = ("passw", "secret", "credential", "apikey", "accesskey", "privatekey", "authtoken")
# A last part that only says which form a secret takes: the part before it decides.
QUALIFIERS = frozenset({"id", "value", "base", "b64", "base64", "hex", "str", "string", "raw", "data", "env"})

# Variables that hold a directory or a search path, spelled as the shell and the loaders spell them:
# never secret, whatever their parts say (PWD's one part is "pwd"; `pwd=` in a query string stays secret).
PLAIN_NAMES = frozenset({
    "PWD", "OLDPWD", "HOME", "PATH", "TMPDIR", "TMP", "TEMP", "SHELL", "VIRTUAL_ENV", "CONDA_PREFIX",
    "PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONPYCACHEPREFIX", "LD_LIBRARY_PATH", "LIBRARY_PATH",
    "MANPATH", "INFOPATH", "CUDA_HOME", "CUDA_PATH", "HF_HOME",
})
_PLAIN_XDG = re.compile(r"XDG_[A-Z]+(?:_[A-Z]+)*_(?:DIR|DIRS|HOME)")

_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")


def name_parts(name: str) -> list[str]:
    """'HF_TOKEN' -> ['hf', 'token']; '--api-key' -> ['api', 'key']; 'authToken' -> ['auth', 'token']."""
    return [p.lower() for p in _SPLIT.split(name) if p]


def is_secret_name(name: str) -> bool:
    """Whether a variable, flag or key of this name holds a secret (the rule in the module docstring)."""
    if name in PLAIN_NAMES or _PLAIN_XDG.fullmatch(name):
        return False
    parts = name_parts(name)
    if not parts:
        return False
    if any(s in p for p in parts for s in SECRET_STEMS):
        return True
    if parts[-1] in SECRET_PARTS or tuple(parts[-2:]) in SECRET_PHRASES:
        return True
    if parts[-1] in QUALIFIERS and len(parts) > 1:
        return parts[-2] in SECRET_PARTS or tuple(parts[-3:-1]) in SECRET_PHRASES
    return False


# --- values by shape ------------------------------------------------------------------------------

# Each pattern takes time linear in the text it is given (tests/test_security_redact.py checks it on
# repeated prefixes of each): a scan that can fail is never begun again inside the stretch a failed one
# covered.
_SHAPES: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    # scheme://user:password@host and scheme://token@host: the whole userinfo goes.
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]{1,20}://)[^\s/@'\"<>]+@"), r"\1" + REDACTED + "@"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.S), REDACTED),
    (re.compile(r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1\2" + REDACTED),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"), REDACTED),
    (re.compile(r"\bhf_[A-Za-z0-9]{8,}"), REDACTED),
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{20,})"), REDACTED),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{8,}"), REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA)[A-Z0-9]{16}\b"), REDACTED),
    # A JWT; where none starts, the rest of the run is taken as it is: every later 'eyJ' in the same run
    # ends where this one does and fails alike, and trying each ('eyJ-eyJ-eyJ-...') rescanned the run.
    (re.compile(r"\beyJ(?:(?P<jwt>[A-Za-z0-9_-]{5,}+\.eyJ[A-Za-z0-9_-]{5,}+\.[A-Za-z0-9_-]*+)|[A-Za-z0-9_-]*+)"),
     lambda m: REDACTED if m["jwt"] is not None else m[0]),
    # A long hex or base64 run after '=' (not a path: it would start with '/').
    (re.compile(r"(=\s*['\"]?)(?:[0-9a-fA-F]{32,}|(?=[A-Za-z0-9+/_-]*[0-9])(?=[A-Za-z0-9+/_-]*[A-Z])"
                r"(?=[A-Za-z0-9+/_-]*[a-z])[A-Za-z0-9+_-][A-Za-z0-9+/_-]{39,}={0,2})(?=$|[\s'\",;&)\]}])"),
     r"\1" + REDACTED),
)

# name=value, name: value, "name": "value" and --name=value in free text; a quoted value runs to its quote,
# a listed one to the first ']' on its line (_assigned_sub keeps that branch from rescanning a line).
_ASSIGNED = re.compile(
    r"(?<![A-Za-z0-9_.-])(?P<name>-{0,2}[A-Za-z_][A-Za-z0-9_.-]*)(?P<q1>['\"]?)(?P<sep>\s*[=:](?!//)\s*)"
    r"(?:\[(?P<listed>[^\]\n]*+)\]"
    r"|(?P<q2>['\"])(?P<quoted>.{0,4096}?)(?:(?P=q2)|$)"
    r"|(?P<bare>(?i:(?:bearer|basic|token|digest) )?[^\s'\",;&)\]}]+))"
)
# --name value (a flag and the word after it) in a joined command line.
_FLAG_VALUE = re.compile(r"(?<![A-Za-z0-9_.-])(?P<name>--?[A-Za-z][A-Za-z0-9_.-]*)(?P<sep>\s+)(?P<q>['\"]?)"
                         r"(?P<value>[^\s'\",;&)\]}-][^\s'\",;&)\]}]*)")
_NOT_VALUES = frozenset({"None", "null", "True", "False", "true", "false", "[]", "{}"})


_LIST_ITEM = re.compile(r"(['\"])(?:(?!\1).)+\1|(?<![\w.-])(?!None\b|null\b)[^\s,'\"]+")


def _assigned(m: re.Match[str], unopened: str = "[") -> str:
    """One _ASSIGNED match as it is shown; `unopened` stands in for a '[' that opens no list (_assigned_sub)."""
    if m["listed"] is not None:  # api_key: ['k1', 'k2'] (how vLLM logs a list-valued flag)
        if not is_secret_name(m["name"].lstrip("-")):
            return m[0]
        items = _LIST_ITEM.sub(lambda i: f"{i[1]}{REDACTED}{i[1]}" if i[1] else REDACTED, m["listed"])
        return f"{m['name']}{m['q1']}{m['sep']}[{items}]"
    value = m["bare"] if m["bare"] is not None else m["quoted"]
    if not value or not is_secret_name(m["name"].lstrip("-")) or value.startswith(REDACTED):
        return m[0]
    if value[0] in "[{(" or value[0] == unopened or value in _NOT_VALUES:
        return m[0]  # a structure, or no value at all (`'api_key': None`), is not itself a secret
    q2 = m["q2"] or ""
    return f"{m['name']}{m['q1']}{m['sep']}{q2}{REDACTED}{q2}"


def _assigned_sub(text: str) -> str:
    """_ASSIGNED over text in linear time. A '[' with no ']' after it on its line opens no list, and the
    list branch would run to the line's end from each one (`a: [` repeated: a minute for 400 KB). For
    the one pass, each such '[' becomes a character the text does not hold, which no branch scans past
    as a list; the match is otherwise the same (such a '[' could only begin a bare value, itself shown)."""
    lines = text.split("\n") if "[" in text else []
    dead = [i for i, line in enumerate(lines) if line.find("[", line.rfind("]") + 1) >= 0]
    if not dead:
        return _ASSIGNED.sub(_assigned, text)
    unopened = _unused_char(text)
    if unopened is None:  # a text that holds every private-use character: in two parts, cut at a line if one is near
        half = len(text) // 2
        cut = text.rfind("\n", half // 2, half) + 1 or half
        return _assigned_sub(text[:cut]) + _assigned_sub(text[cut:])
    for i in dead:
        cut = lines[i].rfind("]") + 1
        lines[i] = lines[i][:cut] + lines[i][cut:].replace("[", unopened)
    out = _ASSIGNED.sub(lambda m: _assigned(m, unopened), "\n".join(lines))
    return out.replace(unopened, "[")


def _unused_char(text: str) -> str | None:
    """A private-use character (no branch of _ASSIGNED takes it as a name, space or quote) not in text."""
    used: set[str] | str = text
    for cp in itertools.chain(range(0xE000, 0xF900), range(0xF0000, 0x10FFFE)):
        if chr(cp) not in used:
            return chr(cp)
        if used is text:
            used = set(text)  # a text that holds the first one is looked up in a set, not rescanned
    return None


def _flag_value(m: re.Match[str]) -> str:
    if not is_secret_name(m["name"].lstrip("-")) or m["value"].startswith(REDACTED):
        return m[0]
    return f"{m['name']}{m['sep']}{m['q']}{REDACTED}"


def redact_text(text: str) -> str:
    """Free text (a log line, an error message, a joined command line) with every secret replaced."""
    if not text:
        return text
    for pattern, repl in _SHAPES:
        text = pattern.sub(repl, text)
    text = _assigned_sub(text)
    return _FLAG_VALUE.sub(_flag_value, text)


# What could end a line, move the cursor, recolour a terminal or reorder what it shows: C0 and C1
# controls, DEL, the Unicode line and paragraph separators, the bidirectional overrides and isolates,
# and lone surrogates (from argv or file names not in UTF-8; printing one would raise).
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    c = m[0]
    return _ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def printable(text: str) -> str:
    """text on one line, as a terminal or a log shows it and nothing else: every character that could
    end the line, move the cursor, colour or reorder the text becomes a visible escape (\\n, \\x1b,
    \\u202e). For every name, label, path or argv word a target chose, printed as text. Backslashes stay
    as they are, so printable(printable(s)) == printable(s)."""
    return _UNPRINTABLE.sub(_escape, text) if _UNPRINTABLE.search(text) else text


@overload
def redact_url(url: str) -> str: ...
@overload
def redact_url(url: None) -> None: ...
def redact_url(url: str | None) -> str | None:
    """A URL without its user:password (and without secret query values)."""
    return None if url is None else redact_text(url)


# --- structured values ----------------------------------------------------------------------------


def _redact_arg(arg: str) -> str:
    if "=" in arg and not arg.startswith("-") and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*=.*", arg, re.S):
        name, value = arg.split("=", 1)
        return f"{name}={REDACTED}" if value and is_secret_name(name) else f"{name}={redact_text(value)}"
    return redact_text(arg)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """argv with secret values replaced: ``--api-key X``, ``--api-key=X``, ``FOO_PASS=X`` and secret shapes.
    A deployment's few argvs come back every sample (`top`: every second): each is redacted once."""
    key = tuple(str(a) for a in argv)
    hit = _REDACTED_ARGVS.get(key)
    if hit is None:
        if len(_REDACTED_ARGVS) > 256:
            _REDACTED_ARGVS.clear()
        hit = _REDACTED_ARGVS[key] = tuple(_redact_argv(key))
    return list(hit)


_REDACTED_ARGVS: dict[tuple[str, ...], tuple[str, ...]] = {}


def _redact_argv(argv: Iterable[str]) -> list[str]:
    out: list[str] = []
    hide_next = False
    for arg in argv:
        arg = str(arg)
        if hide_next and not arg.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if arg.startswith("-") and not arg.startswith("---"):
            name, eq, value = arg.partition("=")
            if is_secret_name(name.lstrip("-")) and " " not in name:
                if eq:
                    out.append(f"{name}={REDACTED}" if value else arg)
                else:
                    out.append(arg)
                    hide_next = True
                continue
        out.append(_redact_arg(arg))
    return out


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment with secret-named variables replaced and secret shapes in the others."""
    return {k: (REDACTED if v and is_secret_name(k) else redact_text(v)) for k, v in env.items()}


def redact_obj(obj: Any) -> Any:
    """A JSON-like tree (dicts, lists, strings) with every secret replaced; keys name secrets too."""
    if isinstance(obj, str):
        return redact_text(obj)
    if isinstance(obj, Mapping):
        return {k: (REDACTED if isinstance(v, str) and v and is_secret_name(str(k)) else redact_obj(v))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return obj
