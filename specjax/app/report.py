"""What `specjax.sample` prints: samples as they finish (ArS and SpS side by side in
--mode=both) and the summary (ms/token, tokens per loop, acceptance rate, speedup), and
the JSONL record of every sample."""
from __future__ import annotations

import itertools
import shutil
import sys
import textwrap
from typing import Optional, Sequence

from specjax.config import SamplingConfig
from specjax.decode.metrics import Totals


LABEL = {"ars": "ArS", "sps": "SpS"}


class Report:
    """Collects per-batch results into JSONL records, prints samples and the summary."""

    def __init__(self, modes: Sequence[str], sampling: SamplingConfig, tokenizer, print_samples: bool = True,
                 out=sys.stdout, load_seconds: Optional[float] = None):
        self.modes, self.sampling, self.tokenizer = list(modes), sampling, tokenizer
        self.print_samples, self.out, self.load_seconds = print_samples, out, load_seconds
        self.totals = {m: Totals() for m in self.modes}
        self.done_batches = 0
        self.stopped_at_once = {m: 0 for m in self.modes}  # rows whose first new token ended them
        import jax
        self.is_main = jax.process_index() == 0  # the other processes of a pod run stay quiet

    def text(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, tokens))
        return self.tokenizer.decode([t for t in tokens if t not in self.tokenizer.stop_ids])

    def add_batch(self, batch_index: int, seed: int, prompts, rows, results: dict) -> list[dict]:
        records = []
        for mode, result in results.items():
            self.totals[mode].add(result, rows=len(rows))  # rows past len(rows) pad the batch: not reported
            for j, (i, s) in enumerate(rows):
                stats = result.row_stats(j)
                self.stopped_at_once[mode] += self.stopped_at_once_row(result.tokens[j])
                record = {"mode": mode, "prompt_index": i, "sample_index": s, "source": prompts[i].source,
                          "prompt": prompts[i].text, "prompt_tokens": prompts[i].tokens,
                          "tokens": result.tokens[j]}
                if self.tokenizer is not None:
                    record["text"] = self.text(result.tokens[j])
                record.update(batch=batch_index, seed=seed, batch_ms_per_token=result.ms_per_token, stats=stats)
                records.append(record)
        self.done_batches += 1
        if self.print_samples and self.is_main:
            self._print_batch(prompts, rows, results)
        return records

    def stopped_at_once_row(self, tokens: Sequence[int]) -> bool:
        """The row's only new token is a stop token: its completion is empty."""
        return len(tokens) == 1 and tokens[0] in self.sampling.stop_ids

    def completion(self, tokens: Sequence[int]) -> str:
        """A row's text, or what ended it where that leaves nothing to show."""
        if self.stopped_at_once_row(tokens):
            return "(stopped at end-of-sequence after 1 token: nothing generated)"
        return self.text(tokens)

    def _header(self, mode: str, result) -> str:
        head = f"{LABEL[mode]}{f' K={result.lookahead}' if mode == 'sps' else ''}: {result.ms_per_token:.2f} ms/token"
        if mode == "sps" and result.num_drafts > 1:
            head += f", {result.tokens_per_loop:.2f} tokens/loop ({result.drafter}, {result.num_drafts} drafts)"
        elif mode == "sps":
            head += f", acceptance {result.acceptance_rate:.2f} ({result.drafter}, {result.verify})"
        return head

    def _print_batch(self, prompts, rows, results: dict) -> None:
        width = shutil.get_terminal_size((160, 24)).columns
        for j, (i, s) in enumerate(rows):
            p = prompts[i]
            print(f"\n=== {p.source}" + (f" sample {s}" if s else "") + " ===", file=self.out)
            print(p.text if p.text is not None else f"prompt tokens: {' '.join(map(str, p.tokens))}", file=self.out)
            if len(results) == 1:
                (mode, result), = results.items()
                print(f"--- {self._header(mode, result)}", file=self.out)
                print(self.completion(result.tokens[j]), file=self.out, flush=True)
                continue
            print(side_by_side([(self._header(m, r), self.completion(r.tokens[j])) for m, r in results.items()],
                               width), file=self.out, flush=True)

    def summary_lines(self) -> list[str]:
        lines = [] if self.load_seconds is None else [
            f"weights ready in {self.load_seconds:.1f} s (read or initialised, placed, quantized)"]
        for mode, t in self.totals.items():
            line = (f"{LABEL[mode]}: {plural(t.rows, 'sample')}, {plural(t.tokens, 'token')}, "
                    f"{t.ms_per_token:.2f} ms/token, {t.tokens / max(1, t.loops):.2f} tokens/loop")
            if mode == "sps":
                s = self.sampling
                adaptive = f", draft confidence {s.draft_confidence}" if s.draft_confidence else ""
                rule = f"{s.verify} verification" if s.num_drafts == 1 else f"{s.num_drafts} drafts verified as a tree"
                if s.draft_tree == "dynamic":
                    rule = f"a dynamic tree of {s.tree_nodes} nodes verified as a tree"
                line += (f", acceptance rate {t.acceptance_rate:.3f} (K={s.lookahead}, {s.drafter} drafter, "
                         f"{rule}{adaptive})")
                if s.pass_width == "proposed":
                    line += (f"; the target scored {t.scored / max(1, t.loops):.2f} positions/loop "
                             f"(of {s.lookahead + 1})")
                if s.num_drafts > 1:
                    line += "; loops won by chain " + "/".join(map(str, t.chain_won))
                if set(t.proposed_by) - {"model"}:
                    line += "; accepted/proposed by drafter: " + ", ".join(
                        f"{name} {t.accepted_by.get(name, 0)}/{n}" for name, n in t.proposed_by.items())
            line += f"; {t.seconds:.2f} s sampling, {t.compile_seconds:.1f} s compiling"
            lines.append(line)
            if self.stopped_at_once[mode]:
                lines.append(f"{LABEL[mode]}: {plural(self.stopped_at_once[mode], 'sample')} stopped at end-of-sequence "
                             "after 1 token (an instruct model given a plain prompt often ends at once: try --chat)")
        if {"ars", "sps"} <= set(self.totals) and self.totals["sps"].steps:
            speedup = self.totals["ars"].ms_per_token / self.totals["sps"].ms_per_token
            lines.append(f"SpS speedup over ArS: {speedup:.2f}x (ms/token)")
        return lines

    def print_summary(self, interrupted: str = "", output: Optional[str] = None) -> None:
        if not self.is_main:
            return
        s = self.sampling
        print(f"\nsummary (temperature={s.temperature}, top_k={s.top_k}, top_p={s.top_p}, "
              f"max_new_tokens={s.max_new_tokens})" + (f", interrupted after {interrupted}" if interrupted else ""),
              file=self.out)
        for line in self.summary_lines():
            print(line, file=self.out)
        if output:
            print(f"samples written to {output}", file=self.out)
        self.out.flush()


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def side_by_side(columns: Sequence[tuple[str, str]], width: int) -> str:
    """Columns of (header, text) next to each other: headers and long lines wrapped (never
    cut), a wrapped line's continuation indented as the line itself."""
    col = max(30, (width - 3 * (len(columns) - 1)) // len(columns))

    def cell_lines(header: str, text: str) -> list[str]:
        out = textwrap.wrap(header, col) or [""]
        out.append("-" * min(col, max(map(len, out))))
        for line in text.expandtabs(4).split("\n"):
            indent = line[:len(line) - len(line.lstrip(" "))][:col // 2]
            out += textwrap.wrap(line, col, subsequent_indent=indent, replace_whitespace=False) or [""]
        return out

    cells = [cell_lines(h, t) for h, t in columns]
    rows = itertools.zip_longest(*cells, fillvalue="")
    return "\n".join(" | ".join(c.ljust(col) for c in row).rstrip() for row in rows)
