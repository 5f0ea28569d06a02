"""Reading a program's text: the attention kernels it calls, its collectives' bytes, and the bytes it
moves in device memory (the roofline's memory term where the compiler gives no cost analysis)."""

from __future__ import annotations

import math
import re

KERNEL_CALL = "tpu_custom_call"  # how a TPU program calls a Pallas (Mosaic) kernel


def kernel_calls(lowered_text: str) -> int:
    """Pallas kernels the lowered program (StableHLO text) runs, counted as the compiler inlines it:
    a function's kernels once per call of it (a loop's body once).

    Counted here rather than in the compiled program's text: on a slice with SparseCores (v5p) the
    TPU compiler offloads embedding gathers as async ops that jaxlib's HLO reader refuses (a RET_CHECK
    with a C++ stack trace on stderr) when asked for that text.

    Args:
        lowered_text: the lowered program's StableHLO text.

    Returns:
        The count.
    """
    own: dict[str, int] = {}
    calls: dict[str, list[str]] = {}
    name = None
    for line in lowered_text.splitlines():
        if m := re.match(r"\s*func\.func (?:public |private )?@([\w.$-]+)\(", line):
            name = m.group(1)
            own[name], calls[name] = 0, []
        if name is None:
            continue
        own[name] += line.count(f"@{KERNEL_CALL}(")
        calls[name] += re.findall(r"\bcall @([\w.$-]+)\(", line)

    def total(f: str, seen: frozenset = frozenset()) -> int:
        if f not in own or f in seen:
            return 0
        return own[f] + sum(total(g, seen | {f}) for g in calls[f])

    return total("main")


def cudnn_calls(compiled_text: str) -> int:
    """cuDNN fused attention calls (forward and backward, `__cudnn$fmha...`) in a compiled GPU program's text.

    Args:
        compiled_text: the compiled program's HLO text.

    Returns:
        The count.
    """
    return len(re.findall(r'custom_call_target="__cudnn\$fmha', compiled_text))


DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip


COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")


def collective_bytes(compiled_text: str) -> dict[str, tuple[int, int]]:
    """The collectives in a compiled (partitioned) HLO module's text, by kind.

    Each op's result shapes (one device's buffers; an async op's `-done`) are summed; a loop's body is
    counted once.

    Args:
        compiled_text: the compiled module's text (several modules may be joined).

    Returns:
        {kind: (bytes, ops)} for each kind in `COLLECTIVES`.
    """
    out = {kind: (0, 0) for kind in COLLECTIVES}
    kinds = "|".join(COLLECTIVES)
    # a tuple result: its elements (long tuples number theirs, /*index=5*/), up to the op's name
    tuple_ = r"\((?:[^=]|/\*index=\d+\*/)*?\)"
    for m in re.finditer(rf"= ({tuple_}|\w+\[[\d,]*\](?:\{{[^}}]*\}})?) ({kinds})(?:-done)?\(", compiled_text):
        size = shape_bytes(m.group(1))
        total, ops = out[m.group(2)]
        out[m.group(2)] = (total + size, ops + 1)
    return out


# One instruction of compiled HLO text: name = shape opcode(operands), attributes.
HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?) ([\w\-]+)\((.*)$")


# Ops that move no data: names for buffers that are already there.
HLO_PLUMBING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id"}


# Ops that read only their result's worth of an operand: a slice of it.
HLO_SLICING = {"dynamic-slice", "slice", "gather"}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape: an array ("bf16[8,128]{1,0}") or a tuple of them.

    Args:
        shape: the shape as the HLO text writes it.

    Returns:
        Bytes.
    """
    return sum(
        DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape)
    )


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction: the text up to its closing parenthesis."""
    depth, end = 0, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        if ch == ")":
            if depth == 0:
                end = i
                break
            depth -= 1
    return re.findall(r"%([\w.\-]+)", rest[:end])


def parse_hlo(text: str) -> tuple[dict[str, list[dict]], str | None]:
    """The computations of an HLO module's text and the entry computation's name.

    Args:
        text: a (compiled) HLO module's text.

    Returns:
        ({computation: its instructions, each a dict of name, shape, op, operands, calls (the
        computations it calls), kind (a fusion's), target (a custom call's), trips (a while loop's
        known trip count, else 1)}, the entry's name or None).
    """
    computations, current, entry = {}, None, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            if m := re.match(r"^(ENTRY )?%?([\w.\-]+)", line):
                current = m.group(2)
                computations[current] = []
                entry = current if m.group(1) else entry
            continue
        m = HLO_INSTRUCTION.match(line)
        if m and current is not None:
            name, shape, op, rest = m.groups()
            called = re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%[\w.\-]+)", line)
            target = re.search(r'custom_call_target="([^"]+)"', line)
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            computations[current].append({
                "name": name, "shape": shape, "op": op, "operands": _operands(rest),
                "calls": [c for group in called for c in re.findall(r"%([\w.\-]+)", group)],
                "kind": (re.search(r"kind=(\w+)", line) or [None, ""])[1], "target": target[1] if target else "",
                "trips": int(trips.group(1)) if trips else 1, "root": line.lstrip().startswith("ROOT "),
                "index": int(rest.split(")")[0]) if op == "parameter" and rest.split(")")[0].isdigit() else None,
            })  # fmt: skip
    return computations, entry


def _moved(op: dict, computations: dict, size: dict) -> int:
    """Bytes one top-level op reads and writes, once: its result and its operands, except what it
    reads or writes only a slice of (a dynamic slice of a layer's weights out of a scan's stack; a
    dynamic update in place, of which only the update moves) and a library call's scratch space."""
    if op["op"] == "fusion" and op["calls"] and computations.get(op["calls"][0]):
        inner = computations[op["calls"][0]]
        params = {i["index"]: i["name"] for i in inner if i["op"] == "parameter"}  # operand index -> name
        users: dict[str, list[dict]] = {}
        for i in inner:
            for o in i["operands"]:
                users.setdefault(o, []).append(i)
        inner_size = {i["name"]: shape_bytes(i["shape"]) for i in inner}
        read = 0
        for k, operand in enumerate(op["operands"]):
            param = params.get(k)
            uses = users.get(param, []) if param else []
            sliced = [u for u in uses if u["op"] in HLO_SLICING and u["operands"][0] == param]
            in_place = [u for u in uses if u["op"] == "dynamic-update-slice" and u["operands"][0] == param]
            if uses and len(sliced) + len(in_place) == len(uses):  # only slices read (an update: only written)
                read += sum(inner_size[u["name"]] for u in sliced)
            else:
                read += size.get(operand, 0)
        by_name = {i["name"]: i for i in inner}
        root = next((i for i in inner if i["root"]), inner[-1])
        written = 0
        for part in [by_name[o] for o in root["operands"] if o in by_name] if root["op"] == "tuple" else [root]:
            in_place = part["op"] == "dynamic-update-slice"  # only the update is written
            written += inner_size.get(part["operands"][1], 0) if in_place else inner_size[part["name"]]
        return read + written
    operands = [size.get(o, 0) for o in op["operands"]]
    if op["op"] in HLO_SLICING:
        return 2 * shape_bytes(op["shape"])
    if op["op"] == "dynamic-update-slice":
        return 2 * operands[1]
    result = shape_bytes(op["shape"])
    if op["op"] == "custom-call" and op["shape"].startswith("("):  # a library call: its u8/s8 scratch is not traffic
        result -= sum(shape_bytes(s) for s in re.findall(r"[us]8\[[\d,]*\]", op["shape"]))
    return result + sum(operands)


def hlo_ops(text: str) -> list[tuple[dict, int, int]]:
    """The top-level ops a compiled HLO module runs, from its entry through loops, calls and
    branches (not inside fusions), with the bytes each moves once and how many times it runs.

    Args:
        text: a compiled HLO module's text.

    Returns:
        [(instruction as `parse_hlo` gives it, bytes moved once, times run)]: a while loop's body
        times its known trip count (once when the compiler does not know it); each branch once.
    """
    computations, entry = parse_hlo(text)
    size = {i["name"]: shape_bytes(i["shape"]) for c in computations.values() for i in c}
    out = []

    def walk(name: str, times: int, seen: frozenset) -> None:
        for op in computations.get(name, []):
            if op["op"] in HLO_PLUMBING:
                continue
            if op["op"] in ("while", "call", "conditional", "async-start"):
                for called in op["calls"]:
                    if called not in seen:
                        walk(called, times * op["trips"], seen | {called})
                continue
            out.append((op, _moved(op, computations, size), times))

    if entry is not None:
        walk(entry, 1, frozenset({entry}))
    return out


def bytes_moved(text: str) -> float:
    """Bytes a compiled program reads and writes in device memory, counted from its text: each
    top-level op (a fusion, a library call, a copy, a collective) reads its operands and writes its
    result once, a slice only the slice, an in-place update only the update, a loop's body once per
    trip. Where XLA gives no cost analysis (its GPU compiler without a GPU), the roofline's memory term.

    Args:
        text: a compiled HLO module's text.

    Returns:
        Bytes per device and step.
    """
    return float(sum(moved * times for _, moved, times in hlo_ops(text)))
