"""The report as a plain-text table (`format_table`) or Markdown (`markdown_table`).
"""

from __future__ import annotations

from typing import Optional

_LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2EL", "e2el_ms"))
_COLUMNS = ("concurrency", "rate/s", "completed", "failed", "duration s", "req/s",
            "output tok/s", "total tok/s",
            *(f"{name} ms mean/median/p99" for name, _ in _LATENCIES),
            "tok/chunk", "cached tok", "RSS MiB after")


def _fixed(v: Optional[float], digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _number(v: Optional[float], unit: str = "") -> str:
    return "-" if v is None else f"{v:.0f}{unit}"


def _latency(stats: dict) -> str:
    return "/".join(_fixed(stats[k]) for k in ("mean", "median", "p99"))


def _cells(row: dict) -> list[str]:
    return [str(row["concurrency"]),
            "inf" if row.get("request_rate") is None else f"{row['request_rate']:g}",
            str(row["completed"]), str(row["errors"]), _fixed(row["wall_s"]),
            _fixed(row["requests_per_s"]), _fixed(row["output_tokens_per_s"]),
            _fixed(row["total_tokens_per_s"]),
            *(_latency(row[key]) for _, key in _LATENCIES),
            _fixed(row["tokens_per_chunk"]), _number(row.get("cached_tokens")),
            _number(row.get("rss_mb_after"))]


def _footer(report: dict) -> str:
    pc = report.get("prefix_cache")
    cache = ("-" if pc is None else
             f"{pc['hits']:.0f} of {pc['queries']:.0f} prompt tokens"
             + ("" if pc["hit_rate"] is None else f" ({pc['hit_rate'] * 100:.1f}%)"))
    return (f"server RSS after warm-up: {_number(report.get('rss_mb_before'), ' MiB')}; "
            f"requests running at the end: {_number(report.get('requests_running_at_end'))}; "
            f"compilations during the run: {_number(report.get('compilations_during_run'))}; "
            f"prefix-cache hits (server metrics): {cache}. "
            "Latencies in ms from the client, mean/median/p99; TPOT = (E2EL - TTFT) / "
            "(output tokens - 1); ITL = gap between successive chunks with text (tok/chunk "
            "tokens each).")


def format_table(report: dict) -> str:
    """A plain-text table of the levels, then the memory and metrics line."""
    rows = [list(_COLUMNS)] + [_cells(r) for r in report["levels"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines + [_footer(report)])


def markdown_table(report: dict) -> str:
    """The same table in Markdown (for reports such as `bench --report`'s report.md)."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---:|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in report["levels"]]
    return "\n".join(lines + ["", _footer(report)])
