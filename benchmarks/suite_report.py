"""A suite run's tables (``suite.py``): every entry's rows (a ``bench`` entry's in the columns of its section), the
targets with PASS / FAIL / n/a, the entries' states, and the run as a markdown section for ``docs/benchmarks.md``."""

from __future__ import annotations

from elastic_ssm.bench import COLUMNS, format_table, markdown_section

__all__ = ["rows_table", "suite_tables", "suite_markdown"]


def rows_table(rows: list[dict], title: str) -> str:
    """Rows of any entry kind as a table: the columns of their bench section, else every scalar column in the
    order first seen; a ``target`` column (PASS / FAIL) when a target judged a row."""
    sections = list(dict.fromkeys(r.get("section") for r in rows))
    if len(sections) > 1:
        return "\n\n".join(rows_table([r for r in rows if r.get("section") == s], f"{title} / {s}")
                            for s in sections)
    cols = list(COLUMNS.get(sections[0] or "", []))
    if not cols:
        cols = [k for k in dict.fromkeys(k for r in rows for k in r)
                if k not in ("section", "target") and all(not isinstance(r.get(k), (list, dict)) for r in rows)]
    if any("target" in r for r in rows):
        cols = [c for c in cols if c != "error"] + ["target"] + (["error"] if "error" in cols else [])
    return format_table(rows, cols, title=title)


def suite_tables(results: dict) -> str:
    """Every entry's rows, the targets with PASS / FAIL / n/a, and the entries skipped or failed."""
    parts = []
    for e in results.get("entries", []):
        if e.get("rows"):
            parts.append(rows_table(e["rows"], f"## {e['name']} ({e['kind']})"))
    if results.get("targets"):
        parts.append(format_table(results["targets"], ["entry", "target", "row", "value", "status", "why"],
                                  title="## targets"))
    states = [{"entry": e["name"], "kind": e["kind"], "state": e["state"], "seconds": e.get("seconds")}
              for e in results.get("entries", [])]
    if states:
        parts.append(format_table(states, ["entry", "kind", "state", "seconds"], title="## entries"))
    return "\n\n".join(parts)


def suite_markdown(results: dict) -> str:
    """One suite run as a markdown section (``markdown_section``) of its tables."""
    return markdown_section(results, f"suite `{results.get('suite')}` on ", suite_tables(results))
