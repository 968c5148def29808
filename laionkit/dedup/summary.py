"""`laionkit stats DIR` for a dedup folder: what each layer removed and what was kept, from its stats.json."""

from __future__ import annotations

from laionkit.common import LaionkitError
from laionkit.common.storage import Location
from laionkit.dedup.config import STATS_NAME


def summarize(folder: Location):
    """stats.json as a table; a folder whose stats.json is missing is a dedup that has not finished."""
    from rich.table import Table

    if not (folder / STATS_NAME).exists():
        raise LaionkitError(f"{folder}: keep.parquet without {STATS_NAME}: a dedup that did not finish; rerun it")
    stats = (folder / STATS_NAME).read_json()
    table = Table(title=f"laionkit dedup: {folder}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = stats["rows_in"]
    table.add_row("inputs", f"{len(stats['inputs']):,}" + (f" (against {len(stats['against'])})" if stats["against"]
                                                             else ""))
    table.add_row("rows in", f"{rows:,}")
    if stats.get("keep"):
        table.add_row("rows in --keep", f"{stats['rows_in_keep']:,} ({stats['not_in_keep']:,} not listed)")
    for layer, removed in stats["removed"].items():
        table.add_row(f"removed by {layer}", f"{removed:,}")
    table.add_row("kept", f"{stats['kept']:,} of {rows:,}" + (f" ({100 * stats['kept'] / rows:.1f}%)" if rows else ""))
    if stats.get("clusters") is not None:
        table.add_row("semantic clusters", f"{stats['clusters']:,}")
    if stats.get("phash_bands") is not None:
        table.add_row("pHash bands", str(stats["phash_bands"]))
    return table
