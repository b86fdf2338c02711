"""Collectives in compiled HLO text, counted per generation loop and outside it.

`HloProgram` parses `compiled.as_text()` into computations and who calls whom;
`loop_and_outside` counts the collectives of one iteration of the generation `while`
(nested loops such as the layer scan and the draft scan multiplied by their trip
counts) and, separately, those outside it (prefill, set-up). Tests check the
invariants of the fused loop with it (2 all-reduces per layer, per step).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def _shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string; a tuple is the sum of its arrays."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _group_size(line: str) -> int:
    """Devices per replica group, from any of the three HLO spellings (the mesh form may
    carry `device_ids=(...)` before the axes it names)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=\{([^}]*)\}", line)  # collective-permute
    return 2 if m else 1


_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")


_CALLED = re.compile(r"\b(?:to_apply|calls|body|condition)=%?([\w.\-]+)|"
                     r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # 'all-reduce', 'all-gather', ...
    shape: str  # HLO result shape without layout, e.g. 'f32[1,5,8192]'
    bytes: int  # per device: the reduced buffer (all-reduce) or the gathered result (all-gather)
    group: int  # devices that take part


class HloProgram:
    """The computations of a compiled module's text, and who calls whom."""

    def __init__(self, text: str):
        self.computations: dict[str, list[str]] = {}
        self.entry = None
        current = None
        for line in text.splitlines():
            header = _COMP_HEADER.match(line)
            if header and not line.startswith(" "):
                current = header.group(2)
                self.computations[current] = []
                if header.group(1):
                    self.entry = current
            elif line.startswith("}"):
                current = None
            elif current is not None:
                self.computations[current].append(line)
        if self.entry is None:
            raise ValueError("no ENTRY computation in the HLO text")
        self._memo: dict[tuple, Counter] = {}

    @staticmethod
    def _callees(line: str) -> list[str]:
        return [name.strip().lstrip("%") for one, many in _CALLED.findall(line)
                for name in ([one] if one else many.split(",")) if name.strip()]

    @staticmethod
    def trip_count(line: str) -> int | None:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        return int(m.group(1)) if m else None

    def instructions(self, name: str):
        """(instruction name, result shape, opcode, line) of one computation."""
        for line in self.computations.get(name, ()):
            m = _INSTR.match(line)
            if m:
                yield m.group(1), m.group(2), m.group(3), line

    def tally(self, name: str, skip: frozenset = frozenset()) -> Counter:
        """Collectives executed by one run of computation `name`, nested loops multiplied
        by their known trip counts; instructions named in `skip` are not entered (at any
        depth). A conditional runs one branch: it counts as its costliest (most collectives,
        then most bytes), an upper bound (the draft steps an adaptive or hybrid loop may skip
        sit in one branch; a lookup loop without proposals scores one token in the other)."""
        key = (name, skip)
        if key in self._memo:
            return self._memo[key]
        counts: Counter = Counter()
        for instr, shape, op, line in self.instructions(name):
            if instr in skip:
                continue
            base = op[:-len("-start")] if op.endswith("-start") else op
            if base in COLLECTIVES:
                shape = re.sub(r"\{[\d,]*\}", "", shape)
                size = _shape_bytes(shape)
                if op.endswith("-start") and base != "all-reduce" and shape.startswith("("):
                    size = max(_shape_bytes(a) for a in re.findall(r"\w+\[[\d,]*\]", shape))  # (in, out): out
                counts[Collective(base, shape, size, _group_size(line))] += 1
            times = (self.trip_count(line) or 1) if op == "while" else 1
            called = [self.tally(callee, skip) for callee in self._callees(line)]
            if op == "conditional" and called:
                called = [max(called, key=lambda t: (sum(t.values()), sum(c.bytes * n for c, n in t.items())))]
            for tally in called:
                for c, n in tally.items():
                    counts[c] += n * times
        self._memo[key] = counts
        return counts

    def generation_loop(self) -> tuple[str, str]:
        """(name, line) of the one `while` whose trip count is unknown: the ArS step / SpS
        loop (layer scans, the draft scan and RNG loops all have known trip counts)."""
        loops = [(instr, line) for comp in self.computations for instr, _, op, line in self.instructions(comp)
                 if op == "while" and self.trip_count(line) is None]
        if len(loops) != 1:
            raise ValueError(f"expected one data-dependent while loop, found {[n for n, _ in loops]}")
        return loops[0]

    def loop_and_outside(self) -> tuple[Counter, Counter]:
        """(collectives per iteration of the generation loop, collectives outside it)."""
        name, line = self.generation_loop()
        per_loop = Counter()
        for callee in self._callees(line):  # body and condition both run once per iteration
            per_loop.update(self.tally(callee))
        return per_loop, self.tally(self.entry, skip=frozenset({name}))


def summarize(counts: Counter) -> dict:
    """{kind: {'count', 'bytes', 'messages': [{'shape', 'bytes', 'group', 'count'}]}}."""
    out = {}
    for kind in COLLECTIVES:
        items = sorted(((c, n) for c, n in counts.items() if c.kind == kind), key=lambda cn: (-cn[1], cn[0].shape))
        if items:
            out[kind] = {"count": sum(n for _, n in items), "bytes": sum(c.bytes * n for c, n in items),
                         "messages": [{"shape": c.shape, "bytes": c.bytes, "group": c.group, "count": n}
                                      for c, n in items]}
    return out
