"""A small CEL evaluator for the `x-kubernetes-validations` rules of CRDs.

TEST STAND-IN, never product code. It implements only what the CRDs served
here use (the ImexEnsemble CRD of host_agent/crd/imexensemble.py), with CEL's semantics
for those parts:

- literals: integers, doubles, strings (single/double quoted, raw `r'..'`,
  the usual backslash escapes), `true`/`false`/`null`, lists `[a, b]`;
- `self`, `oldSelf`, field selection `a.b` (an absent field is an error,
  "no such key"), indexing `a[k]`;
- `!`, unary `-`, `* / %`, `+ -`, `< <= > >= == !=`, `in` (list member,
  map key), `&&` and `||` with CEL's commutative error absorption
  (`error && false` is false), `c ? a : b`;
- macros `has(a.b)`, `l.all(x, p)`, `l.exists(x, p)` (lists by element,
  maps by key); functions `size(x)` / `x.size()`, `s.matches(re)` (RE2
  partial match, through Python's `re`), `s.startsWith`, `s.endsWith`,
  `s.contains`.

Not implemented (the rules here do not use them): type checking at CRD
creation, the cost estimator (the realk8s tier proves the real server's
estimator accepts the CRD), messageExpression, optionals, timestamps and
durations, quantity/url/ip libraries, uints, bytes. An expression outside
the subset raises `CelError` when it is parsed, so a new rule fails loudly
in the double instead of passing unchecked; tests/realk8s/test_double_parity.py
compares its verdicts with the real apiserver's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any


class CelError(Exception):
    """A parse error, or an evaluation error (CEL's `error` value)."""


_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<num>\d+\.\d+(?:[eE][+-]?\d+)?|0x[0-9a-fA-F]+|\d+)
  | (?P<str>[rR]?(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"))
  | (?P<op>\|\||&&|==|!=|<=|>=|[-+*/%!<>?:.,()\[\]{}])
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
""", re.VERBOSE)

_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "`": "`", "?": "?", "a": "\a", "b": "\b",
            "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}


def _unquote(text: str) -> str:
    raw = text[0] in "rR"
    body = text[2:-1] if raw else text[1:-1]
    if raw:
        return body
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif nxt in "xX":
            out.append(chr(int(body[i + 2:i + 4], 16)))
            i += 4
        elif nxt == "u":
            out.append(chr(int(body[i + 2:i + 6], 16)))
            i += 6
        elif nxt.isdigit():
            out.append(chr(int(body[i + 1:i + 4], 8)))
            i += 4
        else:
            raise CelError(f"invalid escape sequence \\{nxt}")
    return "".join(out)


def _tokens(src: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if m is None:
            raise CelError(f"unexpected character {src[pos]!r} at {pos}")
        pos = m.end()
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append((kind, m.group()))
    out.append(("end", ""))
    return out


Node = tuple[Any, ...]
_RESERVED = {"true": True, "false": False, "null": None}


class _Parser:
    def __init__(self, src: str) -> None:
        self.toks = _tokens(src)
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i]

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.toks[self.i]
        if value is not None and tok[1] != value:
            raise CelError(f"expected {value!r}, found {tok[1] or 'end of input'!r}")
        self.i += 1
        return tok

    def accept(self, value: str) -> bool:
        if self.peek()[1] == value and self.peek()[0] == "op":
            self.i += 1
            return True
        return False

    def parse(self) -> Node:
        node = self.expr()
        if self.peek()[0] != "end":
            raise CelError(f"unexpected {self.peek()[1]!r}")
        return node

    def expr(self) -> Node:
        cond = self.binary(0)
        if self.accept("?"):
            yes = self.binary(0)
            self.take(":")
            return ("cond", cond, yes, self.expr())
        return cond

    _LEVELS: tuple[tuple[str, ...], ...] = (
        ("||",), ("&&",), ("<", "<=", ">", ">=", "==", "!=", "in"), ("+", "-"), ("*", "/", "%"))

    def binary(self, level: int) -> Node:
        if level == len(self._LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        ops = self._LEVELS[level]
        while self.peek()[1] in ops:
            op = self.take()[1]
            left = ("bin", op, left, self.binary(level + 1))
        return left

    def unary(self) -> Node:
        if self.accept("!"):
            return ("not", self.unary())
        if self.accept("-"):
            return ("neg", self.unary())
        return self.member()

    def args(self) -> list[Node]:
        out: list[Node] = []
        if self.accept(")"):
            return out
        while True:
            out.append(self.expr())
            if self.accept(")"):
                return out
            self.take(",")

    def member(self) -> Node:
        node = self.primary()
        while True:
            if self.accept("."):
                kind, name = self.take()
                if kind != "id":
                    raise CelError(f"expected a field or method name after '.', found {name!r}")
                if self.accept("("):
                    node = ("call", name, node, self.args())
                else:
                    node = ("select", node, name)
            elif self.accept("["):
                index = self.expr()
                self.take("]")
                node = ("index", node, index)
            else:
                return node

    def primary(self) -> Node:
        kind, text = self.take()
        if kind == "num":
            if text.startswith("0x"):
                return ("lit", int(text, 16))
            return ("lit", float(text)) if "." in text else ("lit", int(text))
        if kind == "str":
            return ("lit", _unquote(text))
        if kind == "id":
            if text in _RESERVED:
                return ("lit", _RESERVED[text])
            if self.accept("("):
                return ("call", text, None, self.args())
            return ("ident", text)
        if text == "(":
            node = self.expr()
            self.take(")")
            return node
        if text == "[":
            items: list[Node] = []
            if not self.accept("]"):
                while True:
                    items.append(self.expr())
                    if self.accept("]"):
                        break
                    self.take(",")
            return ("list", items)
        raise CelError(f"unexpected {text or 'end of input'!r}")


@cache
def compile_rule(src: str) -> Node:
    """Parse `src` once (CelError if it is outside the subset)."""
    return _Parser(src).parse()


def uses_old_self(src: str) -> bool:
    """A transition rule: evaluated only on update, where the old value exists."""
    return _mentions(compile_rule(src), "oldSelf")


def _mentions(node: Any, name: str) -> bool:
    if isinstance(node, tuple):
        if node[:2] == ("ident", name):
            return True
        return any(_mentions(n, name) for n in node)
    if isinstance(node, list):
        return any(_mentions(n, name) for n in node)
    return False


@dataclass(frozen=True)
class _Env:
    vars: Mapping[str, Any]

    def bind(self, name: str, value: Any) -> _Env:
        return _Env({**self.vars, name: value})


def evaluate(src: str, self_value: Any, old_self: Any = None, has_old: bool = False) -> Any:
    """The value of rule `src` for `self` (and `oldSelf`); CelError for CEL's error."""
    env: dict[str, Any] = {"self": self_value}
    if has_old:
        env["oldSelf"] = old_self
    return _eval(compile_rule(src), _Env(env))


def _same_type(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return True
    return type(a) is type(b) or (isinstance(a, Mapping) and isinstance(b, Mapping))


def _equal(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if not _same_type(a, b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise CelError(f"no such overload: {what} applied to {type(value).__name__}")
    return value


def _try(node: Node, env: _Env) -> tuple[Any, CelError | None]:
    try:
        return _eval(node, env), None
    except CelError as e:
        return None, e


def _logical(op: str, left: Node, right: Node, env: _Env) -> bool:
    decisive = op == "||"  # the value that decides the result alone
    lv, lerr = _try(left, env)
    if lerr is None and _bool(lv, op) is decisive:
        return decisive
    rv, rerr = _try(right, env)
    if rerr is None and _bool(rv, op) is decisive:
        return decisive
    if lerr is not None:
        raise lerr
    if rerr is not None:
        raise rerr
    return not decisive


def _compare(op: str, a: Any, b: Any) -> bool:
    if op == "==":
        return _equal(a, b)
    if op == "!=":
        return not _equal(a, b)
    if op == "in":
        if isinstance(b, Mapping):
            return a in b
        if isinstance(b, list):
            return any(_equal(a, x) for x in b)
        raise CelError(f"no such overload: in applied to {type(b).__name__}")
    if not _same_type(a, b) or isinstance(a, (bool, list, Mapping)) or a is None:
        raise CelError(f"no such overload: {op} on {type(a).__name__}, {type(b).__name__}")
    return bool({"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op])


def _arith(op: str, a: Any, b: Any) -> Any:
    if op == "+" and isinstance(a, str) and isinstance(b, str):
        return a + b
    if op == "+" and isinstance(a, list) and isinstance(b, list):
        return a + b
    if isinstance(a, bool) or isinstance(b, bool) or not (
            isinstance(a, (int, float)) and isinstance(b, (int, float))):
        raise CelError(f"no such overload: {op} on {type(a).__name__}, {type(b).__name__}")
    if op in ("/", "%") and b == 0:
        raise CelError("division by zero" if op == "/" else "modulus by zero")
    if op == "/" and isinstance(a, int) and isinstance(b, int):
        return int(a / b)  # CEL truncates toward zero
    if op == "%" and isinstance(a, int) and isinstance(b, int):
        return a - b * int(a / b)
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b, "%": a % b}[op]


def _size(value: Any) -> int:
    if isinstance(value, (str, list, Mapping)):
        return len(value)
    raise CelError(f"no such overload: size applied to {type(value).__name__}")


_STRING_METHODS: dict[str, Callable[[str, str], bool]] = {
    "matches": lambda s, pattern: re.search(pattern, s) is not None,
    "startsWith": lambda s, p: s.startswith(p),
    "endsWith": lambda s, p: s.endswith(p),
    "contains": lambda s, p: p in s,
}


def _call(node: Node, env: _Env) -> Any:
    _, name, target, args = node
    if name == "has":
        if target is not None or len(args) != 1 or args[0][0] != "select":
            raise CelError("invalid argument to has() macro")
        _, operand, field = args[0]
        obj = _eval(operand, env)
        if not isinstance(obj, Mapping):
            raise CelError(f"has() on a {type(obj).__name__}")
        return field in obj
    if name in ("all", "exists"):
        if target is None or len(args) != 2 or args[0][0] != "ident":
            raise CelError(f"invalid arguments to {name}() macro")
        coll = _eval(target, env)
        if not isinstance(coll, (list, Mapping)):
            raise CelError(f"no such overload: {name} applied to {type(coll).__name__}")
        var, pred = args[0][1], args[1]
        results = []
        errors: list[CelError] = []
        for item in coll:  # a map iterates over its keys
            value, err = _try(pred, env.bind(var, item))
            if err is not None:
                errors.append(err)
                continue
            results.append(_bool(value, name))
        if name == "all":
            if not all(results):
                return False
        elif any(results):
            return True
        if errors:
            raise errors[0]
        return name == "all"
    values = [_eval(a, env) for a in args]
    if name == "size":
        if target is None and len(values) == 1:
            return _size(values[0])
        if target is not None and not values:
            return _size(_eval(target, env))
    if name in _STRING_METHODS and target is not None and len(values) == 1:
        subject = _eval(target, env)
        if not isinstance(subject, str) or not isinstance(values[0], str):
            raise CelError(f"no such overload: {name}")
        try:
            return _STRING_METHODS[name](subject, values[0])
        except re.error as e:
            raise CelError(f"invalid regular expression: {e}") from e
    raise CelError(f"undeclared reference to '{name}' (not in the sandbox's CEL subset)")


def _eval(node: Node, env: _Env) -> Any:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "ident":
        if node[1] not in env.vars:
            raise CelError(f"undeclared reference to '{node[1]}'")
        return env.vars[node[1]]
    if kind == "select":
        obj = _eval(node[1], env)
        if not isinstance(obj, Mapping):
            raise CelError(f"no such field {node[2]!r} on {type(obj).__name__}")
        if node[2] not in obj:
            raise CelError(f"no such key: {node[2]}")
        return obj[node[2]]
    if kind == "index":
        obj, key = _eval(node[1], env), _eval(node[2], env)
        if isinstance(obj, Mapping):
            if key not in obj:
                raise CelError(f"no such key: {key}")
            return obj[key]
        if isinstance(obj, list) and isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(obj):
                raise CelError(f"index out of bounds: {key}")
            return obj[key]
        raise CelError("no such overload: index")
    if kind == "list":
        return [_eval(n, env) for n in node[1]]
    if kind == "not":
        return not _bool(_eval(node[1], env), "!")
    if kind == "neg":
        value = _eval(node[1], env)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CelError("no such overload: -")
        return -value
    if kind == "cond":
        return _eval(node[2] if _bool(_eval(node[1], env), "?:") else node[3], env)
    if kind == "bin":
        op = node[1]
        if op in ("&&", "||"):
            return _logical(op, node[2], node[3], env)
        a, b = _eval(node[2], env), _eval(node[3], env)
        if op in ("<", "<=", ">", ">=", "==", "!=", "in"):
            return _compare(op, a, b)
        return _arith(op, a, b)
    if kind == "call":
        return _call(node, env)
    raise CelError(f"unsupported expression {kind}")
