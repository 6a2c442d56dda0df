"""Settings declared once: each a dataclass field with its help, parser and check, from which
the command-line flag (``--max-batch-images``) and the environment variable
(``VIT22B_MAX_BATCH_IMAGES``) are generated, as TEI's clap arguments do. A flag wins over its
variable, the variable over the default. jax-free and grpc-free: every ``vit22b`` command uses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from vit22b.model.schema import real_number, whole_number

PREFIX = "VIT22B_"


def setting(
    default: Any = None,
    help: str = "",  # noqa: A002 - argparse's word
    *,
    parse: Callable[[str], Any] | None = None,
    check: Callable[[Any], str | None] | None = None,
    flag: str | None = None,
    repeat: bool = False,
    factory: Callable[[], Any] | None = None,
    cli: bool = True,
    short: str | None = None,
    shown: str | None = None,
) -> Any:
    """A dataclass field declaring one setting.

    ``parse``: text -> value (default: the field's type); ``check``: value -> an error message
    or None; ``flag``: when it differs from the field name; ``repeat``: a flag given several
    times (its variable separates values with ``;``); ``cli=False``: a field with no flag;
    ``shown``: the default as the flag spells it, where the value's own text is not that."""
    meta = {"help": help, "parse": parse, "check": check, "flag": flag, "repeat": repeat,
            "cli": cli, "short": short, "shown": shown}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def env_of(field: dataclasses.Field) -> str:
    return PREFIX + flag_of(field).lstrip("-").replace("-", "_").upper()


def positive(value) -> str | None:
    return _infinite(value) or (None if value is None or value > 0 else
                                f"must be positive, got {value}")


def non_negative(value) -> str | None:
    return _infinite(value) or (None if value is None or value >= 0 else
                                f"must be >= 0, got {value}")


def _infinite(value) -> str | None:
    """Infinity (or NaN) is no bound: a timeout or a wait of ``inf`` never ends, and the clocks
    and integer sizes it reaches overflow."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    return None


def one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    """A check: the value is one of ``choices``."""
    return lambda value: None if value in choices else (
        f"must be one of {', '.join(choices)}, got {value!r}")


def at_most(limit: float, why: str, rule: Callable[[Any], str | None] = positive
            ) -> Callable[[Any], str | None]:
    """``rule``, and at most ``limit`` (``why``: what larger values would break or mean)."""
    def check(value) -> str | None:
        problem = rule(value)
        if problem or value is None or value <= limit:
            return problem
        return f"must be at most {limit:g} ({why}), got {value}"
    return check


# --compute-dtype of `vit22b serve` and of local jobs: auto (the server plan's choice: the
# model's dtype, or float32 where this CPU has no bf16 instructions), a dtype, or none (the
# checkpoint's or preset's on every host).
COMPUTE_DTYPES = ("auto", "bfloat16", "float32")
COMPUTE_DTYPE_HELP = (
    "matmul input dtype: bfloat16, float32 (exact features), or auto: the checkpoint's, else "
    "the preset's, except float32 on a CPU without bf16 instructions (avx512_bf16, AMX, Arm's "
    "bf16), where bfloat16 runs slower; none: the checkpoint's or preset's on every host")


def compute_dtype(text: str) -> str | None:
    if text in ("", "none", "None"):
        return None
    if text not in COMPUTE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"--compute-dtype is {', '.join(COMPUTE_DTYPES)} or none, got {text!r}")
    return text


TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_tls(text: str) -> bool | str:
    """``--tls`` alone (the system's roots), a PEM of trusted roots, or a word of true or false
    (as every flag of this kind reads them: ``VIT22B_TLS=on`` is not a file named ``on``)."""
    word = text.strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else text


def _parser_of(field: dataclasses.Field) -> Callable[[str], Any]:
    parse = field.metadata.get("parse")
    if parse is not None:
        return parse
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    for name, fn in (("bool", _bool), ("int", whole_number), ("float", real_number)):
        if kind.startswith(name):
            return fn
    return str


def _is_bool(field: dataclasses.Field) -> bool:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    return kind.startswith("bool")


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


# A value made of negative numbers: argparse takes a token starting with '-' for a flag unless
# it is one number, so `--layers -1,-4` was "expected one argument".
_NEGATIVE_NUMBERS = re.compile(r"-\d+(\.\d+)?(,\s*-?\d+(\.\d+)?)*")


def spell_flags(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``args`` spelled so that argparse reads them as a user means them.

    - A boolean flag that no true or false follows becomes ``--flag=true``: a boolean flag
      takes an optional value (``--quiet false`` for the variable's symmetry), so argparse took
      the argument after a bare one as its value (``vit22b embed --quiet photos/ -o out``
      refused ``photos/`` as a boolean). What follows a bare flag stays itself.
    - A flag taking one value, followed by a list of numbers starting with a negative one
      (``--layers -1,-4``), becomes ``--layers=-1,-4``.
    """
    flags = {option for action in parser._actions if action.type is _bool
             for option in action.option_strings}
    valued = {option for action in parser._actions
              if action.option_strings and action.nargs is None and action.type is not _bool
              and not isinstance(action, argparse._StoreConstAction | argparse._HelpAction)
              for option in action.option_strings}
    spelled: list[str] = []
    at = 0
    while at < len(args):
        token = args[at]
        if token == "--":
            return spelled + args[at:]
        after = args[at + 1] if at + 1 < len(args) else "-"
        if token in flags and not after.startswith("-") and (
                after.strip().lower() not in TRUE_WORDS + FALSE_WORDS):
            token += "=true"
        elif token in valued and _NEGATIVE_NUMBERS.fullmatch(after):
            token, at = f"{token}={after}", at + 1
        spelled.append(token)
        at += 1
    return spelled


def default_of(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def add_arguments(
    parser: argparse.ArgumentParser, cls: type, environ: Mapping[str, str] = os.environ
) -> None:
    """One flag per declared setting of ``cls``, its default from the environment (parsed by
    ``from_args``, so that a bad variable is the command's refusal naming it, not a failure
    of ``--help``)."""
    for field in dataclasses.fields(cls):
        if not field.metadata.get("cli", False):
            continue
        flag, env, parse = flag_of(field), env_of(field), _parser_of(field)
        flags = [flag] + ([field.metadata["short"]] if field.metadata.get("short") else [])
        default = default_of(field)
        spelled = field.metadata.get("shown") or _show(default)
        shown = "" if default in (None, (), "") else f"; default {spelled}"
        help_ = f"{field.metadata['help']} (${env}{shown})"
        text = environ.get(env)
        if text is not None:
            default = Variable(env, text)
        if field.metadata["repeat"]:
            parser.add_argument(*flags, dest=field.name, type=parse, action=_Repeat, help=help_,
                                default=None if text is None else default)
        elif _is_bool(field):  # ``--flag`` alone means true
            parser.add_argument(*flags, dest=field.name, type=parse, nargs="?", const=True,
                                action=_Store, default=default, help=help_)
        else:
            parser.add_argument(*flags, dest=field.name, type=parse, action=_Store,
                                default=default, help=help_)


@dataclasses.dataclass(frozen=True)
class Variable:
    """A setting's value as its environment variable holds it, parsed by ``from_args``."""

    name: str
    text: str

    def value(self, field: dataclasses.Field):
        parse = _parser_of(field)
        try:
            if field.metadata["repeat"]:
                return [parse(v) for v in self.text.split(";") if v.strip()]
            return parse(self.text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
            raise ValueError(f"${self.name}={self.text!r}: {err}") from None

    def check(self, field: dataclasses.Field, value) -> None:
        """The setting's declared check of ``value``, read from this variable: a refusal names
        the variable, which the user set, beside the flag, which they may never have typed."""
        refusal = _refusal(field, value)
        if refusal:
            raise ValueError(f"${self.name}={self.text!r}: {refusal}")


def typed(args: argparse.Namespace, name: str) -> bool:
    """Whether setting ``name`` was given on the command line (its variable's value, like its
    default, was not)."""
    return getattr(args, f"_given_{name}", False)


class _Store(argparse.Action):
    """argparse's ``store``, noting that the flag was typed."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, f"_given_{self.dest}", True)
        setattr(namespace, self.dest, values)


class _Repeat(argparse.Action):
    """Like ``append``, but the first use on the command line replaces the default (the
    variable's values) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        marker = f"_given_{self.dest}"
        current = getattr(namespace, self.dest) if getattr(namespace, marker, False) else None
        setattr(namespace, marker, True)
        setattr(namespace, self.dest, [*(current or []), values])


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return ";".join(str(v) for v in value)
    return str(value)


def from_args(cls: type, args: argparse.Namespace, unread: frozenset[str] = frozenset(),
              **extra):
    """The settings object from parsed flags (fields without a flag keep their defaults). A
    value from a variable is parsed here (ValueError naming the variable); the variables of the
    settings ``unread`` are not read (their defaults stand, unless their flags were typed)."""
    values = {}
    for field in dataclasses.fields(cls):
        if field.metadata.get("cli", False) and hasattr(args, field.name):
            value = getattr(args, field.name)
            variable = value if isinstance(value, Variable) and field.name not in unread else None
            if isinstance(value, Variable):
                value = default_of(field) if variable is None else variable.value(field)
            if field.metadata["repeat"]:
                value = tuple(value) if value else default_of(field)
            if variable is not None:
                variable.check(field, value)
            values[field.name] = value
    return cls(**values, **extra)


def _refusal(field: dataclasses.Field, value) -> str | None:
    """The flag and the problem, where the setting's declared check refuses ``value``."""
    rule = field.metadata.get("check")
    problem = rule(value) if rule else None
    return f"{flag_of(field)} {problem}" if problem else None


def check(settings) -> None:
    """Each declared check; ValueError naming the flag and the problem."""
    for field in dataclasses.fields(settings):
        refusal = _refusal(field, getattr(settings, field.name))
        if refusal:
            raise ValueError(refusal)


def describe(cls: type) -> list[tuple[str, str, str, str]]:
    """(flag, variable, default, help) of every setting: the table the docs show."""
    return [
        (flag_of(f), env_of(f), _show(default_of(f)), f.metadata["help"])
        for f in dataclasses.fields(cls)
        if f.metadata.get("cli", False)
    ]
