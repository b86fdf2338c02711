"""Compiled HLO text, read for what a program does per generation loop and per step.

`HloProgram` parses `compiled.as_text()` of either compiler, XLA:CPU's or XLA:TPU's,
into computations, their instructions (shape with layout and memory space, opcode,
operands) and who calls whom.

* `loop_and_outside` counts the collectives of one iteration of the generation `while`
  (nested loops such as the layer scan and the draft scan multiplied by their trip
  counts) and, separately, those outside it (prefill, set-up). Tests check the
  invariants of the fused loop with it (2 all-reduces per layer, per step).
* `traffic` counts, for one run of a program (a costed step), the bytes its instructions
  read from HBM and the FLOPs of its matmuls, loops multiplied by their trip counts
  (`Traffic`; the definition is in docs/pods.md).

Trip counts: XLA:CPU writes `known_trip_count` on a counted loop; XLA:TPU writes none,
so a loop whose condition compares its induction variable with a constant, started from
a constant and stepped by one (what `lax.scan` and `fori_loop` lower to), gets its count
from those three instructions (`trip_count`). The generation loop is the one
data-dependent while that no other data-dependent while holds (XLA:TPU's program has
several while loops; the layer and draft scans are counted ones).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}


def _shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (logical: tile padding is not counted); a tuple is
    the sum of its arrays."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", shape):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return int(total)


def _dims(shape: str) -> list[int]:
    m = re.match(r"\s*[a-z]+\d*[a-z0-9]*\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _elements_as(shape: str, source: str) -> int:
    """Bytes of `shape`'s elements in `source`'s element type: what a slice of `source`
    reads (XLA:TPU fuses a convert into a slice, which then reads f32 and writes bf16)."""
    dtype = re.match(r"\s*([a-z]+\d*[a-z0-9]*)\[", source)
    return int(math.prod(_dims(shape)) * DTYPE_BYTES.get(dtype.group(1) if dtype else "", 0)) or _shape_bytes(shape)


def memory_space(shape: str) -> int:
    """The memory space of an array shape: `S(n)` in its layout, 0 (HBM; host RAM for
    XLA:CPU) where none is written. On a TPU the others are on-chip memories (VMEM, and
    CMEM on v4) and the scalar and semaphore spaces."""
    m = re.search(r"S\((\d+)\)", shape.split("]", 1)[1] if "]" in shape else "")
    return int(m.group(1)) if m else 0


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


def _operands(line: str, op: str) -> list[str]:
    """Names of an instruction's operands: the %names inside its opcode's parentheses
    (XLA:CPU writes each with its shape, XLA:TPU the name alone)."""
    start = line.index(f" {op}(") + len(op) + 2
    depth, end = 1, start
    while depth and end < len(line):
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        end += 1
    return re.findall(r"%([\w.\-]+)", line[start:end - 1])


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # 'all-reduce', 'all-gather', ...
    shape: str  # HLO result shape without layout, e.g. 'f32[1,5,8192]'
    bytes: int  # per device: the reduced buffer (all-reduce) or the gathered result (all-gather)
    group: int  # devices that take part


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # with layout and memory space, as printed
    op: str
    line: str
    operands: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What one run of a computation costs per device, loops times their trip counts:
    hbm_read: bytes its instructions read from memory space 0 (HBM on a TPU) as operands
    (a fusion's operand that it only slices counts the slices; a copy into on-chip memory
    counts once, where it reads HBM, and the reads from the copy not at all); flops: 2 x
    multiply-adds of every dot and convolution."""

    hbm_read: int = 0
    flops: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.hbm_read + other.hbm_read, self.flops + other.flops)

    def __mul__(self, n: int) -> "Traffic":
        return Traffic(self.hbm_read * n, self.flops * n)


# Instructions that read nothing themselves: names, tuples, views, the ends of async pairs,
# and control flow (what the called computations read is counted there).
_NO_READ = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-done", "while", "call",
            "conditional", "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency",
            "domain", "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done", "slice-done",
            "async-update", "send-done", "recv-done", "rng-get-and-update-state"}
# Arithmetic that XLA's cost analysis counts one FLOP per element (transcendentals apart).
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare",
                "select", "clamp", "and", "or", "xor", "not", "remainder", "power", "sign", "floor", "ceil",
                "round-nearest-even", "round-nearest-afz", "shift-left", "shift-right-logical",
                "shift-right-arithmetic"}
# Inside a fusion, what a slice after these reads is all they read of their operand.
_PASSING = _ELEMENTWISE | {"bitcast", "copy", "convert", "reshape", "transpose", "bitcast-convert"}
# Reading only part of the operand: the result's bytes (a slice, a gather of rows).
_SLICING = {"dynamic-slice", "slice", "gather"}
# In place: operand 0 is updated, only the update is read.
_UPDATING = {"dynamic-update-slice": 1, "scatter": 2}


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
        self._parsed: dict[str, dict[str, Instruction]] = {}
        self._traffic: dict[str, Traffic] = {}

    @staticmethod
    def _callees(line: str) -> list[str]:
        return [name.strip().lstrip("%") for one, many in _CALLED.findall(line)
                for name in ([one] if one else many.split(",")) if name.strip()]

    def instructions(self, name: str):
        """(instruction name, result shape, opcode, line) of one computation."""
        for line in self.computations.get(name, ()):
            m = _INSTR.match(line)
            if m:
                yield m.group(1), m.group(2), m.group(3), line

    def parsed(self, name: str) -> dict[str, Instruction]:
        """One computation's instructions by name, in order."""
        if name not in self._parsed:
            self._parsed[name] = {i: Instruction(i, shape, op, line, tuple(_operands(line, op)))
                                  for i, shape, op, line in self.instructions(name)}
        return self._parsed[name]

    def _root(self, name: str) -> Instruction | None:
        for line in self.computations.get(name, ()):
            if line.lstrip().startswith("ROOT "):
                return self.parsed(name).get(_INSTR.match(line).group(1))
        return None

    def _resolve(self, comp: str, name: str) -> Instruction | None:
        """The instruction a value comes from, through copies, bitcasts and converts."""
        instr = self.parsed(comp).get(name)
        while instr is not None and instr.op in ("copy", "bitcast", "convert", "reshape") and instr.operands:
            instr = self.parsed(comp).get(instr.operands[0])
        return instr

    def _constant(self, comp: str, name: str) -> int | None:
        instr = self._resolve(comp, name)
        m = instr and instr.op == "constant" and re.search(r" constant\((-?\d+)\)", instr.line)
        return int(m.group(1)) if m else None

    def trip_count(self, comp: str, line: str) -> int | None:
        """Iterations of the `while` at `line` in computation `comp`: XLA's
        known_trip_count where written (XLA:CPU), else the counted-loop pattern: the
        condition compares tuple element i with a constant N (i < N, i <= N, N > i,
        N >= i), the loop starts i at a constant c and its body adds 1 to it. None for
        any other loop (the generation loop: it stops when every row is done)."""
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        if m:
            return int(m.group(1))
        cond = re.search(r"\bcondition=%?([\w.\-]+)", line)
        body = re.search(r"\bbody=%?([\w.\-]+)", line)
        root = cond and self._root(cond.group(1))
        if root is None or root.op != "compare" or len(root.operands) != 2:
            return None
        direction = re.search(r"direction=(\w+)", root.line)
        sides = [self._resolve(cond.group(1), o) for o in root.operands]
        for which in (0, 1):
            index, bound = sides[which], self._constant(cond.group(1), root.operands[1 - which])
            if index is None or index.op != "get-tuple-element" or bound is None:
                continue
            i = int(re.search(r"index=(\d+)", index.line).group(1))
            kind = direction.group(1) if direction else ""
            kind = kind if which == 0 else {"GT": "LT", "GE": "LE"}.get(kind, "")
            if kind not in ("LT", "LE"):
                return None
            init = self._element(comp, _operands(line, "while")[0], i)
            start = None if init is None else self._constant(comp, init)
            if start is None or not self._steps_by_one(body.group(1), i):
                return None
            return max(0, bound - start + (kind == "LE"))
        return None

    def _element(self, comp: str, name: str, i: int) -> str | None:
        instr = self._resolve(comp, name)
        return instr.operands[i] if instr is not None and instr.op == "tuple" and i < len(instr.operands) else None

    def _steps_by_one(self, body: str, i: int) -> bool:
        root = self._root(body)
        if root is None or root.op != "tuple" or i >= len(root.operands):
            return False
        step = self._resolve(body, root.operands[i])
        if step is None or step.op != "add" or len(step.operands) != 2:
            return False
        consts = [self._constant(body, o) for o in step.operands]
        gtes = [self._resolve(body, o) for o in step.operands]
        return any(c == 1 and g is not None and g.op == "get-tuple-element"
                   and re.search(rf"index={i}\b", g.line) for c, g in zip(consts[::-1], gtes))

    def tally(self, name: str, skip: frozenset = frozenset()) -> Counter:
        """Collectives executed by one run of computation `name`, nested loops multiplied
        by their trip counts; instructions named in `skip` are not entered (at any
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
                shape = re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", shape)
                size = _shape_bytes(shape)
                if op.endswith("-start") and base != "all-reduce" and shape.startswith("("):
                    size = max(_shape_bytes(a) for a in re.findall(r"\w+\[[\d,]*\]", shape))  # (in, out): out
                if op.endswith("-start") and base == "all-reduce" and shape.startswith("("):
                    shape = re.findall(r"\w+\[[\d,]*\]", shape)[0]  # a tuple-shaped start: one buffer
                    size = _shape_bytes(shape)
                counts[Collective(base, shape, size, _group_size(line))] += 1
            times = self._times(name, line) if op == "while" else 1
            called = [self.tally(callee, skip) for callee in self._callees(line)]
            if op == "conditional" and called:
                called = [max(called, key=lambda t: (sum(t.values()), sum(c.bytes * n for c, n in t.items())))]
            for tally in called:
                for c, n in tally.items():
                    counts[c] += n * times
        self._memo[key] = counts
        return counts

    def _times(self, comp: str, line: str) -> int:
        """A nested loop's trip count; a data-dependent loop inside the one counted is an
        error (its collectives would be counted once whatever it runs)."""
        n = self.trip_count(comp, line)
        if n is None:
            raise ValueError(f"a while loop without a known trip count inside the counted computation: "
                             f"{_INSTR.match(line).group(1)}")
        return n

    def _data_dependent(self) -> list[tuple[str, str, str]]:
        return [(comp, instr, line) for comp in self.computations for instr, _, op, line in self.instructions(comp)
                if op == "while" and self.trip_count(comp, line) is None]

    def _reachable(self, roots: list[str]) -> set[str]:
        seen, todo = set(), list(roots)
        while todo:
            comp = todo.pop()
            if comp not in seen:
                seen.add(comp)
                todo += [c for line in self.computations.get(comp, ()) for c in self._callees(line)]
        return seen

    def generation_loop(self) -> tuple[str, str]:
        """(name, line) of the generation loop: the one data-dependent `while` (no known
        or inferable trip count: the ArS step / SpS loop) that no other data-dependent
        while holds. XLA:CPU's program holds one such loop; XLA:TPU's may hold more inside
        it; the layer scans, the draft scan and RNG loops are counted loops."""
        loops = self._data_dependent()
        inner = self._reachable([c for _, _, line in loops for c in self._callees(line)])
        live = self._reachable([self.entry])
        outer = [(instr, line) for comp, instr, line in loops if comp not in inner and comp in live]
        if len(outer) != 1:
            raise ValueError(f"expected one data-dependent while loop, found {[n for n, _ in outer]}")
        return outer[0]

    def loop_and_outside(self) -> tuple[Counter, Counter]:
        """(collectives per iteration of the generation loop, collectives outside it)."""
        name, line = self.generation_loop()
        per_loop = Counter()
        for callee in self._callees(line):  # body and condition both run once per iteration
            per_loop.update(self.tally(callee))
        return per_loop, self.tally(self.entry, skip=frozenset({name}))

    # ------------------------------------------------------------------ bytes and FLOPs

    def traffic(self, name: str | None = None) -> Traffic:
        """`Traffic` of one run of computation `name` (default: the whole program, which
        must then hold counted loops only: a costed step)."""
        name = self.entry if name is None else name
        if name in self._traffic:
            return self._traffic[name]
        total = Traffic()
        table = self.parsed(name)
        for instr in table.values():
            if instr.op == "while":
                times = self._times(name, instr.line)
                total += sum((self.traffic(c) for c in self._callees(instr.line)), Traffic()) * times
            elif instr.op == "conditional":
                branches = [self.traffic(c) for c in self._callees(instr.line)]
                total += max(branches, key=lambda t: (t.hbm_read, t.flops), default=Traffic())
            elif instr.op in ("call", "async-start"):
                total += sum((self.traffic(c) for c in self._callees(instr.line)), Traffic())
            elif instr.op == "fusion":
                fused = self._callees(instr.line)[0]
                total += Traffic(sum(self._fused_read(fused, j, table.get(o))
                                     for j, o in enumerate(instr.operands)), self._flops(fused))
            else:
                total += Traffic(self._read(table, instr), self._matmul_flops(table, instr))
        self._traffic[name] = total
        return total

    def reads(self, name: str | None = None, times: int = 1) -> list[tuple[int, str, Instruction]]:
        """Every HBM read `traffic` counts, as (bytes over the run, computation,
        instruction), largest first: where a step's bytes go."""
        name = self.entry if name is None else name
        out = []
        table = self.parsed(name)
        for instr in table.values():
            if instr.op == "while":
                n = self._times(name, instr.line) * times
                out += [r for c in self._callees(instr.line) for r in self.reads(c, n)]
            elif instr.op in ("call", "async-start", "conditional"):
                out += [r for c in self._callees(instr.line) for r in self.reads(c, times)]
            elif instr.op == "fusion":
                fused = self._callees(instr.line)[0]
                read = sum(self._fused_read(fused, j, table.get(o)) for j, o in enumerate(instr.operands))
                out.append((read * times, name, instr))
            else:
                out.append((self._read(table, instr) * times, name, instr))
        return sorted((r for r in out if r[0]), key=lambda r: -r[0])

    @staticmethod
    def _hbm_bytes(operand: Instruction | None) -> int:
        if operand is None or operand.shape.startswith("(") or memory_space(operand.shape) != 0:
            return 0
        return _shape_bytes(operand.shape)

    def _read(self, table: dict[str, Instruction], instr: Instruction) -> int:
        """HBM bytes one unfused instruction reads."""
        if instr.op in _NO_READ:
            return 0
        operands = [table.get(o) for o in instr.operands]
        if instr.op in _SLICING:
            return _elements_as(instr.shape, operands[0].shape) if self._hbm_bytes(operands[0]) else 0
        if instr.op == "slice-start":  # async: ((operand), slice, context); it reads the slice
            arrays = re.findall(r"\w+\[[\d,]*\]", instr.shape)
            return _shape_bytes(arrays[1]) if len(arrays) > 1 and self._hbm_bytes(operands[0]) else 0
        if instr.op in _UPDATING:
            j = _UPDATING[instr.op]
            return self._hbm_bytes(operands[j]) if j < len(operands) else 0
        if instr.op == "copy-start":
            return self._hbm_bytes(operands[0])
        return sum(self._hbm_bytes(o) for o in operands)

    def _fused_read(self, fused: str, j: int, operand: Instruction | None) -> int:
        """HBM bytes a fusion reads of its operand j: none in on-chip memory; the slices
        where the fused computation only slices it (a layer of a stacked weight, rows of
        a table), none where it only updates it in place; else all of it."""
        full = self._hbm_bytes(operand)
        if not full:
            return 0
        param = self._parameter(fused, j)
        part = None if param is None else self._partial_elements(fused, param.name)
        if part is None:
            return full
        return min(full, int(part * DTYPE_BYTES.get(re.match(r"\s*(\w+)\[", operand.shape).group(1), 0)))

    def _parameter(self, comp: str, j: int) -> Instruction | None:
        return next((i for i in self.parsed(comp).values() if i.op == "parameter"
                     and re.search(rf" parameter\({j}\)", i.line)), None)

    def _partial_elements(self, comp: str, name: str, outer: tuple = ()) -> int | None:
        """Elements of value `name` in fused computation `comp` that the fusion reads, when
        every use ends in a slice or an in-place update: a fusion computes only what its
        result needs, so relayouts, converts and elementwise arithmetic on the way (or a
        nested fusion of them) read what the slice after them reads. None where some use
        reads it whole. `outer`: the (computation, fusion) pairs that hold `comp`."""
        table = self.parsed(comp)
        root = self._root(comp)
        if root is not None and root.name == name:  # the (nested) fusion's result: its users decide
            return self._partial_elements(*outer[-1], outer[:-1]) if outer else None
        total = 0
        for user in table.values():
            for k, o in enumerate(user.operands):
                if o != name:
                    continue
                if user.op in _SLICING and k == 0:
                    total += math.prod(_dims(user.shape))
                elif user.op in _UPDATING and k == 0:
                    pass
                elif user.op in _PASSING:
                    part = self._partial_elements(comp, user.name, outer)
                    if part is None:
                        return None
                    total += part
                elif user.op == "fusion":
                    inner = self._callees(user.line)[0]
                    param = self._parameter(inner, k)
                    part = None if param is None else self._partial_elements(inner, param.name,
                                                                            outer + ((comp, user.name),))
                    if part is None:
                        return None
                    total += part
                else:
                    return None
        return total

    def _flops(self, comp: str) -> int:
        table = self.parsed(comp)
        total = 0
        for instr in table.values():
            total += self._matmul_flops(table, instr)
            if instr.op == "fusion":
                total += self._flops(self._callees(instr.line)[0])
        return total

    @staticmethod
    def _matmul_flops(table: dict[str, Instruction], instr: Instruction) -> int:
        """FLOPs as XLA's cost analysis counts them: 2 x (result elements) x (elements
        contracted into each) for a dot (its left operand's contracting dimensions) or a
        convolution (input features per group times the window); one per result element
        of elementwise arithmetic, one per input element of a reduce (XLA:TPU computes a
        one-row matmul as a multiply and a reduce)."""
        if instr.op in _ELEMENTWISE:
            return math.prod(_dims(instr.shape))
        if instr.op == "reduce" and instr.operands and instr.operands[0] in table:
            return math.prod(_dims(table[instr.operands[0]].shape))
        if instr.op not in ("dot", "convolution") or not instr.operands:
            return 0
        lhs = table.get(instr.operands[0])
        if lhs is None:
            return 0
        out, lhs_dims = math.prod(_dims(instr.shape)), _dims(lhs.shape)
        if instr.op == "dot":
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.line)
            contracted = math.prod(lhs_dims[int(d)] for d in m.group(1).split(",") if d) if m else 1
            return 2 * out * contracted
        labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.line)
        if labels is None:
            return 0
        lhs_labels, _, out_labels = labels.groups()
        features = lhs_dims[lhs_labels.index("f")]
        groups = re.search(r"feature_group_count=(\d+)", instr.line)
        out_dims = _dims(instr.shape)
        window = re.search(r"window=\{([^}]*)\}", instr.line)
        window = dict(re.findall(r"(\w+)=([\w\-]+)", window.group(1))) if window else {}
        # XLA writes some matmuls as convolutions whose windows mostly overlap padding or
        # the holes of a dilated input (a dot over a few heads): count the taps that land
        # on the input, per output position, as XLA's cost analysis does.
        pairs, spatial = 1, 1
        for d in range(sum(c.isdigit() for c in lhs_labels)):
            field = lambda key, default: (window[key].split("x")[d] if key in window else default)  # noqa: E731
            size, stride = int(field("size", "1")), int(field("stride", "1"))
            low = int(field("pad", "0_0").split("_")[0])
            lhs_dilate, rhs_dilate = int(field("lhs_dilate", "1")), int(field("rhs_dilate", "1"))
            length, outputs = lhs_dims[lhs_labels.index(str(d))], out_dims[out_labels.index(str(d))]
            pairs *= sum(1 for o in range(outputs) for k in range(size)
                         if (q := o * stride + k * rhs_dilate - low) >= 0 and q % lhs_dilate == 0
                         and q // lhs_dilate < length)
            spatial *= outputs
        return 2 * (out // max(spatial, 1)) * pairs * features // (int(groups.group(1)) if groups else 1)


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
