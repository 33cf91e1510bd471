"""Tables a person reads: every CSV sinkscope writes goes through `storage.csv_text` (numbers to
`CSV_SIGNIFICANT_DIGITS` significant digits, against Python's own `%.6g`; integers, empties and
inf as they read back), and the report's summary (`stats.summary_html`) is one table per
measure without its empty columns, checked by parsing the HTML back."""

from __future__ import annotations

import io
import math
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from sinkscope.analysis import stats
from sinkscope.storage import (
    CSV_SIGNIFICANT_DIGITS,
    csv_rows_text,
    csv_text,
    significant,
    write_csv,
)


def significant_digits(text: str) -> int:
    """The significant digits of a number as a CSV writes it: those of its decimal mantissa
    without leading and trailing zeros ('0.000123' and '1.23e-07' 3, '12.0' 2, '' 0)."""
    mantissa = text.lower().split("e")[0].lstrip("+-").replace(".", "")
    return len(mantissa.strip("0"))


def test_significant_is_printf_g_and_keeps_the_rest():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(20_000) * 10.0 ** rng.integers(-40, 40, 20_000)
    got = significant(values)
    # The reference: C's %.6g, read back (whole numbers aside: they stay exact, below).
    want = np.array([float(f"{v:.6g}") for v in values])
    fractional = values != np.round(values)
    np.testing.assert_array_equal(got[fractional], want[fractional])
    # Printed as pandas prints a float (its shortest repr), each has at most 6 digits.
    assert max(significant_digits(repr(v)) for v in got[fractional].tolist()) <= 6
    special = np.array([0.0, -0.0, 3.0, 1234567.0, np.nan, np.inf, -np.inf, 2.0**53 - 1])
    np.testing.assert_array_equal(significant(special), special)
    assert CSV_SIGNIFICANT_DIGITS == 6
    assert significant([0.5636337574010213], 3).tolist() == [0.564]


def test_csv_text_reads_back_as_written():
    """Integers stay integers, nullable integers and NaN empty, whole floats floats, inf inf,
    text text; every float within 5e-6 of itself and at most 6 digits long in the file."""
    rng = np.random.default_rng(1)
    floats = rng.uniform(-1, 1, 6) * 10.0 ** rng.integers(-8, 8, 6)
    table = pd.DataFrame(
        {
            "name": ["a", "b,c", "d", "e", "f", "g"],
            "count": np.arange(6, dtype=np.int64) * 1_000_003,
            "frames": pd.array([1, None, 3, 4, None, 6], dtype="Int64"),
            "value": floats,
            "whole": [1.0, 2.0, 3.0, 1e7, 0.0, -5.0],
            "psnr": [np.inf, 31.234567891, np.nan, -np.inf, 12.5, 40.0],
            "nullable": pd.array([0.123456789, None, 1.0, 2.5, None, 7.0], dtype="Float64"),
            "mixed": np.array([1, 0.987654321, None, "x", 2.0, 3], dtype=object),
        }
    )
    text = csv_text(table)
    back = pd.read_csv(io.StringIO(text))
    assert back["count"].dtype == np.int64 and back["count"].tolist() == table["count"].tolist()
    assert back["frames"].isna().tolist() == [False, True, False, False, True, False]
    assert back["whole"].dtype == np.float64 and back["whole"].tolist() == table["whole"].tolist()
    assert back["psnr"].dtype == np.float64
    assert back["psnr"].iloc[0] == np.inf and back["psnr"].iloc[3] == -np.inf
    assert math.isnan(back["psnr"].iloc[2])
    np.testing.assert_allclose(back["value"], floats, rtol=5e-6)
    np.testing.assert_allclose(back["nullable"], [0.123457, np.nan, 1, 2.5, np.nan, 7])
    assert back["name"].tolist() == table["name"].tolist()
    cells = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
    for column in ("value", "psnr", "nullable"):
        assert max(significant_digits(v) for v in cells[column] if "inf" not in v) <= 6
    assert cells["mixed"].tolist() == ["1", "0.987654", "", "x", "2.0", "3"]
    assert cells["whole"].tolist()[:3] == ["1.0", "2.0", "3.0"]  # a float column stays floats
    # The table itself is left as it was.
    assert table["value"].tolist() == floats.tolist()


def test_rows_and_tables_are_written_alike(tmp_path):
    """The GPU jobs' rows (`csv_rows_text`, no pandas) and a table (`csv_text`) of the same
    values give the same text: one way of writing numbers."""
    rows = [
        ["c", "p", "full", None, 0, 0, None, 0.0, 1.0, 0, 0, None, None, math.nan],
        ["c", "p", "window", 9, 0, 0, 9, 0.0, 1.0, 1, 0, 0.03277020213100791, 0.9994, 1e-9 / 3],
    ]
    columns = [f"c{i}" for i in range(len(rows[0]))]
    table = pd.DataFrame(rows, columns=columns)
    for column in ("c3", "c6"):
        table[column] = table[column].astype("Int64")
    assert csv_rows_text(columns, rows) == csv_text(table)
    assert csv_rows_text(columns, rows).splitlines()[1:] == [
        "c,p,full,,0,0,,0.0,1.0,0,0,,,",
        "c,p,window,9,0,0,9,0.0,1.0,1,0,0.0327702,0.9994,3.33333e-10",
    ]
    path = write_csv(tmp_path / "t.csv", table)
    assert path.read_text() == csv_text(table)


# --------------------------------------------------------------------------------------------
# the report's summary


class Tables(HTMLParser):
    """The tables of an HTML page: per table its header cells and rows of cells (text)."""

    def __init__(self):
        super().__init__()
        self.tables: list[dict] = []
        self.headings: list[str] = []
        self._cell: list[str] | None = None
        self._heading: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append({"header": [], "rows": []})
        elif tag == "tr":
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "h4":
            self._heading = []

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            text = "".join(self._cell).strip()
            table = self.tables[-1]
            (table["header"] if tag == "th" else table["rows"][-1]).append(text)
            self._cell = None
        elif tag == "h4":
            self.headings.append("".join(self._heading))
            self._heading = None

    def handle_data(self, data):
        for part in (self._cell, self._heading):
            if part is not None:
                part.append(data)


def run_table(prompt: str, shift: float) -> pd.DataFrame:
    """A run's statistics table (`stats.COLUMNS`) of two layers, heads 0, 1 and the head mean,
    two passes, both measures: logit rows without the probability-only statistics (NaN)."""
    rows = []
    passes = [(0, 1000.0, "denoise"), (1, 0.0, "cache")]
    prob_only = {"spread_pct", "uniform_multiple", "recent_mass", "importance"}
    for layer in (0, 1):
        for head in (0, 1, stats.MEAN_HEAD):
            for step, timestep, kind in passes:
                for m, measure in enumerate(stats.MEASURES):
                    row = {"checkpoint": "demo", "prompt": prompt, "layer": layer, "head": head}
                    row |= {"step": step, "timestep": timestep, "pass_kind": kind}
                    row |= {"measure": measure, "query": "last_block", "head_class": ""}
                    for i, column in enumerate(stats.STAT_COLUMNS):
                        if measure == "logit_mean" and column in prob_only:
                            row[column] = math.nan
                        else:
                            row[column] = shift + layer + i / 7 + m / 3 + step / 11
                    rows.append(row)
    return pd.DataFrame(rows, columns=stats.COLUMNS)


def test_the_summary_html_is_one_readable_table_per_measure():
    tables = [run_table("cat", 0.0), run_table("sea", 0.5)]
    summary = stats.summarize(tables)
    page = Tables()
    page.feed(stats.summary_html(summary))
    assert len(page.tables) == 2  # was one table, the measures interleaved row by row
    assert [h.split(":")[0] for h in page.headings] == ["Logits", "Probability"]
    assert all("last_block" in h for h in page.headings)  # the one query set, said once
    means = summary[summary["aggregate"] == "mean"]
    for table, measure in zip(page.tables, stats.MEASURES, strict=True):
        header, rows = table["header"], [row for row in table["rows"] if row]
        mine = means[means["measure"] == measure]
        assert len(rows) == len(mine)
        # No column is empty in every row, none repeats what the heading says.
        for i, name in enumerate(header):
            assert any(row[i] for row in rows), (measure, name)
        assert not {"measure", "query", "prompt", "aggregate", "step", "timestep"} & set(header)
        assert header[:4] == ["checkpoint", "layer", "head", "pass"]
        statistics = [c for c in stats.STAT_COLUMNS if mine[c].notna().any()]
        assert header[4:] == statistics
        # the values: the across-prompt means, 4 significant digits
        for row, (_, want) in zip(rows, mine.iterrows(), strict=True):
            assert row[:3] == ["demo", str(want["layer"]), str(want["head"])]
            t = f"t={want['timestep']:g}" if want["pass_kind"] == "denoise" else "cache"
            assert row[3] == f"{want['step']}: {t}"
            for cell, column in zip(row[4:], statistics, strict=True):
                assert float(cell) == pytest.approx(want[column], rel=5e-4)
    logit, prob = (table["header"] for table in page.tables)
    assert "uniform_multiple" in prob and "uniform_multiple" not in logit
    assert len(logit) <= 17 and len(prob) <= 17  # 22 columns before, at report width now


def test_long_tables_are_written_as_pandas_writes_them():
    """csv_text's own writer for long tables (storage._plain_csv_text) against pandas' to_csv,
    byte for byte: floats with NaN, inf and -0.0, integers, nullable integers with NA, text
    with NA, a mixed object column; and a cell the csv module would quote goes to pandas."""
    from sinkscope.storage import _plain_csv_text

    rng = np.random.default_rng(1)
    rows = 700
    floats = rng.normal(size=rows) * 10.0 ** rng.integers(-300, 300, size=rows)
    floats[:4] = [np.nan, np.inf, -np.inf, -0.0]
    table = pd.DataFrame(
        {
            "value": floats,
            "count": rng.integers(-5, 5, size=rows),
            "flag": rng.integers(0, 2, size=rows).astype(bool),
            "frame": pd.array([None if k % 7 == 0 else k for k in range(rows)], dtype="Int64"),
            "name": pd.array([None if k % 5 == 0 else f"p{k % 3}" for k in range(rows)], "string"),
            "mixed": [1, 1.0, True, "x", None, 2.5, "head"] * (rows // 7),
        }
    )
    assert _plain_csv_text(table) == table.to_csv(index=False)
    assert _plain_csv_text(table.head(10)) is None  # short: pandas writes it
    quoted = table.assign(name="a, b")
    assert _plain_csv_text(quoted) is None
    assert csv_text(quoted).splitlines()[1].endswith(',"a, b",1')
