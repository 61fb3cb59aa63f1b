"""MSL -> C++ text rewrite, signature parsing and the launcher (design note, 3.3-3.4).

The rewrite only does what a header cannot, and every replacement keeps the line count, so
g++ diagnostics and runtime messages point at the Metal text (``#line 1 "kernel.metal"``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import MetalCompileError
from .generator import ATTRIBUTE_TYPES

KERNEL_FILE = "kernel.metal"

_COMMENT_OR_LITERAL = re.compile(
    r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)
_INSTANTIATION = re.compile(
    r'^template \[\[host_name\("[^"]*"\)\]\] \[\[kernel\]\] '
    r'decltype\((?P<call>[^\n]*)\) (?P=call);$', re.M)
_TYPE_ATOM = r"[A-Za-z_][\w:]*(?:\s*<[^;{}()<>]*>)?"
_TG_DECL = re.compile(
    r"(?P<lead>(?:^|[;{}])[ \t]*)threadgroup\s+(?P<type>" + _TYPE_ATOM + r"(?:\s+" + _TYPE_ATOM +
    r")*?)\s+(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\[\];]*\]\s*)*);", re.M)
_TG_WORD = re.compile(r"\bthreadgroup\b")
_HALF_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH](?!\w)")
_SWIZZLE = re.compile(r"(?<=[\w)\]])\.([xyzw]{2,4}|[rgba]{2,4})\b")
_ATTRIBUTE = re.compile(r"\[\[\s*([^\[\]]*?)\s*\]\]")
_DOUBLE = re.compile(r"\bdouble\b")
_STD_ATTRIBUTES = {"maybe_unused", "likely", "unlikely", "fallthrough", "nodiscard", "noreturn",
                   "deprecated"}
_SWZ_INDEX = {c: i for i, c in enumerate("xyzw")} | {c: i for i, c in enumerate("rgba")}


def blank_comments(text: str) -> str:
    """Replace comments by spaces (newlines kept); string and char literals are left alone."""

    def repl(m):
        s = m.group(0)
        if s[0] in "\"'":
            return s
        return re.sub(r"[^\n]", " ", s)

    return _COMMENT_OR_LITERAL.sub(repl, text)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


@dataclass
class Rewritten:
    cpp: str  # the C++ text of the kernel, same line count as the Metal text
    call: str | None  # `K<ARGS>` from the explicit instantiation, None if not templated


def rewrite(metal: str, where) -> Rewritten:
    """``where(line)`` names a line of the Metal text for error messages."""
    text = blank_comments(metal)

    call = None
    m = _INSTANTIATION.search(text)
    if m:
        call = m.group("call")
        text = text[: m.start()] + text[m.end():]  # the line stays, empty

    counter = iter(range(1 << 30))

    def tg_repl(m):
        dims = re.sub(r"\s+", "", m.group("dims"))
        typ = " ".join(m.group("type").split())
        new = (f"{m.group('lead')}auto& {m.group('name')} = "
               f"msim::tg_block<{typ}{dims}, {next(counter)}>();")
        return new + "\n" * m.group(0).count("\n")

    text = _TG_DECL.sub(tg_repl, text)
    for w in _TG_WORD.finditer(text):
        rest = re.match(r"[^;,=(){}]*", text[w.end():]).group(0)
        if "*" not in rest and "&" not in rest:
            raise MetalCompileError(
                f"{where(_line_of(text, w.start()))}: unsupported threadgroup declaration "
                f"'threadgroup{rest.strip() and ' ' + rest.strip()}' "
                "(one declarator per statement, no initialiser: `threadgroup T name[N];`)")

    m = _DOUBLE.search(text)
    if m:
        raise MetalCompileError(f"{where(_line_of(text, m.start()))}: 'double' is not supported "
                                "on Apple GPUs")

    text = _HALF_LITERAL.sub(r"half(\1)", text)
    text = _SWIZZLE.sub(
        lambda m: ".template swz<" + ", ".join(str(_SWZ_INDEX[c]) for c in m.group(1)) + ">()",
        text)

    def attr_repl(m):
        a = m.group(1)
        if a == "kernel" or a in ATTRIBUTE_TYPES or re.fullmatch(r"buffer\(\s*\d+\s*\)", a) \
                or re.fullmatch(r'host_name\("[^"]*"\)', a):
            return ""
        if a.split("(")[0].strip() in _STD_ATTRIBUTES or a.startswith("gnu::"):
            return m.group(0)
        raise MetalCompileError(f"{where(_line_of(text, m.start()))}: unsupported MSL attribute "
                                f"[[{a}]]")

    text = _ATTRIBUTE.sub(attr_repl, text)
    return Rewritten(text, call)


# ------------------------------------------------------------------------------ signature
@dataclass
class Param:
    name: str
    ctype: str  # the declared type, verbatim (address-space words included)
    buffer: int | None  # buffer index, or None for an attribute
    is_ref: bool = False


_PARAM = re.compile(r"^\s*(?P<decl>.+?)\s+\[\[(?P<attr>[^\]]+)\]\](?P<end>,|\) \{)$")


def parse_signature(metal: str, kname: str) -> list[Param]:
    head = f"[[kernel]] void {kname}(\n"
    start = metal.find(head)
    if start < 0:
        raise MetalCompileError(f"metal_sim: kernel signature for {kname} not found")
    params = []
    for line in metal[start + len(head):].split("\n"):
        m = _PARAM.match(line)
        if not m:
            raise MetalCompileError(f"metal_sim: cannot parse signature line {line!r}")
        decl, attr = m.group("decl"), m.group("attr")
        name = re.search(r"([A-Za-z_]\w*)$", decl).group(1)
        ctype = decl[: -len(name)].strip()
        b = re.fullmatch(r"buffer\((\d+)\)", attr)
        params.append(Param(name, ctype, int(b.group(1)) if b else None, ctype.endswith("&")))
        if m.group("end") == ") {":
            break
    return params


def launcher(params: list[Param], call: str) -> str:
    args = []
    for p in params:
        if p.buffer is None:
            if ATTRIBUTE_TYPES[p.name] == "uint3":
                args.append(f"msim::u3(a->{p.name})")
            else:
                args.append(f"a->{p.name}")
        elif p.is_ref:
            args.append(f"*({p.ctype[:-1].strip()}*)b[{p.buffer}]")
        else:
            args.append(f"({p.ctype})b[{p.buffer}]")
    nbufs = sum(p.buffer is not None for p in params)
    return (
        '#line 1 "msim_launcher"\n'
        "static void msim_body(void** b, const msim::Attrs* a) {\n"
        "  (void)b; (void)a;\n"
        f"  {call}(\n    " + ",\n    ".join(args) + ");\n"
        "}\n"
        'extern "C" __attribute__((visibility("default"))) int msim_run(void** b, '
        "const msim::LaunchParams* p, msim::LaunchResult* r) {\n"
        "  return msim_launch(&msim_body, b, p, r);\n"
        "}\n"
        'extern "C" __attribute__((visibility("default"))) '
        f'int msim_nbufs(void) {{ return {nbufs}; }}\n')


def cpp_file(metal: str, kname: str, where) -> tuple[str, list[Param]]:
    """The whole C++ translation unit for one generated Metal text."""
    rw = rewrite(metal, where)
    params = parse_signature(metal, kname)
    call = rw.call or kname
    text = '#include "msl_shim.h"\n#line 1 "' + KERNEL_FILE + '"\n' + rw.cpp
    if not text.endswith("\n"):
        text += "\n"
    return text + launcher(params, call), params


# ------------------------------------------------------------------------------ line mapping
class LineMap:
    """Maps lines of the generated Metal text to ``[header:N]`` / ``[source:N]``."""

    def __init__(self, metal: str, header: str, source: str, kname: str):
        self.header_lines = header.count("\n") + (1 if header and not header.endswith("\n") else 0)
        sig = metal.find(f"[[kernel]] void {kname}(\n")
        body = metal.find(") {\n", sig) + 4 if sig >= 0 else -1
        self.source_start = metal.count("\n", 0, body) + 1 if body > 0 else 10**9
        self.source_lines = source.count("\n") + 1

    def name(self, line: int) -> str:
        if line <= self.header_lines:
            return f"[header:{line}]"
        if self.source_start <= line < self.source_start + self.source_lines:
            return f"[source:{line - self.source_start + 1}]"
        return f"[generated:{line}]"

    def remap(self, text: str) -> str:
        pat = re.compile(re.escape(KERNEL_FILE) + r":(\d+)(?::(\d+))?")

        def repl(m):
            s = self.name(int(m.group(1)))
            return s[:-1] + f":{m.group(2)}]" if m.group(2) else s

        return pat.sub(repl, text)
