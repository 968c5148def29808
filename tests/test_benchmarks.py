"""docs/BENCHMARKS.md is tables of current numbers that README.md may quote: every row names its date, GPU and
command (or says `not run` and why), every command it names is written out under a table, and every number the
README gives as a measurement (samples/s, img/s, GiB, x, %) is in a table row, as written or rounded."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal

from conftest import REPO

BENCHMARKS = REPO / "docs" / "BENCHMARKS.md"
README = REPO / "README.md"

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
# a number (or a range of two) and the unit that makes it a measurement
CLAIM = re.compile(rf"(?<![\w.,/-])({NUMBER})(?:\s?[–-]\s?({NUMBER}))?\s?"
                   r"(samples/s|images/s|img/s|captions/s|rows/s|GiB|×|x(?![\w-])|%)")
UNIT_IN_HEADER = re.compile(r"samples/s|images/s|img/s|captions/s|rows/s|GiB")
RATE = ("samples/s", "images/s", "img/s", "captions/s", "rows/s")
# a paragraph (or list item) that reports a measurement, rather than a setting or an arithmetic example
MEASURED = re.compile(r"measur|BENCHMARKS|\bH[12]00\b|samples/s|img/s|images/s|captions/s|TFLOP", re.I)
BOUND = re.compile(r"(?:under|over|below|above|up to|at most|at least|[<>≤≥~])\s*$", re.I)
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
GPU = re.compile(r"^(?:none|(?:\d+× )?H[12]00)$")
TAG = re.compile(r"^`([a-z0-9]+-\d+)`$")


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Markdown tables outside code blocks, as (header cells, body rows' cells)."""
    found: list[tuple[list[str], list[list[str]]]] = []
    block: list[list[str]] = []
    for line in [*FENCE.sub("", text).splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.replace("\\|", "/").strip().strip("|").split("|")])
            continue
        if len(block) >= 2:
            found.append((block[0], block[2:]))
        block = []
    return found


def defined_commands(text: str) -> dict[str, str]:
    """`# tag` lines in the bash blocks and the command lines under each."""
    commands: dict[str, str] = {}
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for tag, body in re.findall(r"^# ([a-z0-9]+-\d+)\n((?:[^#\n].*\n)+)", block, re.M):
            commands[tag] = body.strip()
    return commands


def named_commands(text: str) -> set[str]:
    """The command tags the rows name."""
    return {tag.group(1) for header, rows in tables(text) if "command" in (names := [c.lower() for c in header])
            for row in rows if (tag := TAG.match(row[names.index("command")]))}


def malformed_rows(text: str) -> list[str]:
    """Each table needs date, GPU and command columns; each row a date, a GPU and a written-out command, or the
    words `not run` with its reason."""
    commands = defined_commands(text)
    problems: list[str] = []
    for header, rows in tables(text):
        names = [cell.lower() for cell in header]
        if not {"date", "gpu", "command"} <= set(names):
            problems.append(f"table {header}: no date, GPU and command columns")
            continue
        date, gpu, command = (names.index(name) for name in ("date", "gpu", "command"))
        for row in rows:
            line = " | ".join(row)
            if len(row) != len(header):
                problems.append(f"{line}: {len(row)} cells under {len(header)} columns")
                continue
            tag = TAG.match(row[command])
            if tag and tag.group(1) not in commands:
                problems.append(f"{line}: command {tag.group(1)} is written out under no table")
            reason = re.search(r"not run\b[:,]?\s*(.*)", line)
            if reason:
                if not reason.group(1).strip(" |"):
                    problems.append(f"{line}: not run, with no reason")
                continue
            if not DATE.match(row[date]) or not GPU.match(row[gpu]) or not tag:
                problems.append(f"{line}: needs a date (YYYY-MM-DD), a GPU (H100, H200, 2× H200 or none) and a command tag")
    return problems


def _decimal(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def table_numbers(text: str, rates_only: bool = False) -> set[Decimal]:
    """Every number in a table row (headers aside), or only those in a column of rates (its header ends in /s)."""
    return {_decimal(number) for header, rows in tables(text) for row in rows
            for name, cell in zip(header, row) if not rates_only or "/s" in name
            for number in re.findall(rf"(?<![\w.]){NUMBER}", cell)}


def quoted_measurements(text: str) -> list[tuple[str, str]]:
    """(number, unit) for each measurement README quotes: a number with a unit in a paragraph or list item that
    reports a measurement (not one after "under" / "over", a bound), the cells of table columns headed by a rate
    or GiB, and a rate or GiB written in any other cell."""
    prose: list[str] = []
    quoted: list[tuple[str, str]] = []
    text = FENCE.sub("", text)
    for line in text.splitlines():
        if not line.startswith("|"):
            prose.append(line)
    for header, rows in tables(text):
        for row in rows:
            for name, cell in zip(header, row):
                unit = UNIT_IN_HEADER.search(name)
                if unit:
                    quoted += [(number, unit.group(0)) for number in re.findall(rf"(?<![\w.]){NUMBER}", cell)]
                else:  # a cell that names its unit: "2.54 samples/s", "100.8 GiB"
                    quoted += [(number, claim.group(3)) for claim in CLAIM.finditer(cell)
                               if UNIT_IN_HEADER.fullmatch(claim.group(3)) for number in claim.group(1, 2) if number]
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.)\s)", "\n".join(prose)):
        paragraph = " ".join(paragraph.split())
        if not MEASURED.search(paragraph):
            continue
        for claim in CLAIM.finditer(paragraph):
            if not BOUND.search(paragraph[:claim.start()]):
                quoted += [(number, claim.group(3)) for number in claim.group(1, 2) if number]
    return quoted


def backed(number: str, unit: str, numbers: set[Decimal], rates: set[Decimal]) -> bool:
    """The number is a table's, as written or rounded to the places it is quoted with; a rate must be in a column
    of rates, a ratio may be quoted inverted ("1.11x faster" for 0.899), a percentage as the ratio's distance
    from 1 ("costs 2.4 %" for 0.976)."""
    value = _decimal(number)
    places = Decimal(1).scaleb(value.as_tuple().exponent)
    candidates = set(rates if unit in RATE else numbers)
    if unit in ("x", "×"):
        candidates |= {1 / n for n in numbers if n}
    if unit == "%":
        candidates |= {abs(1 - n) * 100 for n in numbers}
    return any(n.quantize(places, rounding=ROUND_HALF_UP) == value for n in candidates)


def unbacked(readme: str, benchmarks: str) -> list[str]:
    numbers, rates = table_numbers(benchmarks), table_numbers(benchmarks, rates_only=True)
    return [f"{number} {unit}" for number, unit in quoted_measurements(readme)
            if not backed(number, unit, numbers, rates)]


def test_every_benchmarks_row_names_its_date_gpu_and_command_or_says_why_it_did_not_run():
    assert malformed_rows(BENCHMARKS.read_text()) == []


def test_every_command_written_out_is_named_by_a_row():
    text = BENCHMARKS.read_text()
    assert set(defined_commands(text)) - named_commands(text) == set()


def test_every_measurement_the_readme_quotes_is_in_a_benchmarks_table():
    assert unbacked(README.read_text(), BENCHMARKS.read_text()) == []


BENCH = """
| configuration | ratio | samples/s | peak GiB | GPU | date | command |
| --- | --- | --- | --- | --- | --- | --- |
| Flux, 1024 px | | 1.15 | 88.9 | H200 | 2026-12-01 | `flux-1` |
| the same, online text | online / stored 0.976 | 1.45 | 44.9 | H200 | 2026-12-01 | `flux-1` |
| 2 GPUs | not run: no multi-GPU machine lent | | | | | |

```bash
# flux-1
python3 scripts/bench_train_flow.py --family flux --parts big
```
"""


def test_the_checks_find_an_invented_number_and_a_row_without_its_date_or_command():
    assert malformed_rows(BENCH) == []
    quoting = "Measured on an H200: Flux trains at 1.15 samples/s in 89 GiB; online text costs 2.4 % of the step."
    assert unbacked(quoting, BENCH) == []
    assert unbacked("On an H200 Flux trains at 1.21 samples/s, 3.1× faster.", BENCH) == ["1.21 samples/s", "3.1 ×"]
    assert unbacked("Measured: Flux trains at 88.9 samples/s.", BENCH) == ["88.9 samples/s"]  # a GiB, not a rate
    assert unbacked("Set the top 30 % of rows aside.", BENCH) == []  # no measurement in that sentence
    table = "| family | samples/s | fits |\n| --- | --- | --- |\n| Flux | 1.2 | 89 GiB, DC-AE 32x |\n| SD | 7.5 | 3 GiB |\n"
    assert unbacked(table, BENCH) == ["7.5 samples/s", "3 GiB"]
    undated = BENCH.replace("| H200 | 2026-12-01 | `flux-1` |\n| the same", "| H200 | | `flux-1` |\n| the same", 1)
    assert len(malformed_rows(undated)) == 1
    assert "flux-2" in " ".join(malformed_rows(BENCH.replace("`flux-1` |\n| the same", "`flux-2` |\n| the same")))
    assert malformed_rows(BENCH.replace("not run: no multi-GPU machine lent", "not run")) != []
