"""--cudagraph-metrics' table, logged with the periodic stats line (vLLM 0.32's
CUDAGraphLogging, vllm/compilation/cuda_graph.py, word for word).

The model steps of the interval are counted by their CUDAGraphStat (runner/
cudagraph_stats.py) and logged as one markdown message, the most frequent first:

    **CUDAGraph Config Settings:**

    - Mode: FULL_DECODE_ONLY
    - Capture sizes: [1, 2, 4, 8]

    **CUDAGraph Stats:**

    | Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count |
    |-----------------|---------------|--------------|--------------|-------|
    | 3               | 4             | 1            | FULL         | 12    |
    | 20              | 20            | 0            | NONE         | 1     |

An interval without steps logs nothing. Nothing goes to /metrics: vLLM has no family for it.
"""

from __future__ import annotations

from collections import Counter

from aioserve.runner.cudagraph_stats import CUDAGraphSettings, CUDAGraphStat

COLUMN_HEADERS = ("Unpadded Tokens", "Padded Tokens", "Num Paddings", "Runtime Mode", "Count")


class CUDAGraphTable:
    """The steps since the last table, counted by their CUDAGraphStat."""

    def __init__(self, settings: CUDAGraphSettings) -> None:
        self.settings_header = (
            "**CUDAGraph Config Settings:**\n\n"
            f"- Mode: {settings.mode}\n"
            f"- Capture sizes: {list(settings.capture_sizes)}\n\n"
            "**CUDAGraph Stats:**\n\n"
        )
        self._counts: Counter[CUDAGraphStat] = Counter()

    def observe(self, stat: CUDAGraphStat) -> None:
        self._counts[stat] += 1

    def take(self) -> str | None:
        """The table of the steps counted so far (None: none), and a fresh count."""
        if not self._counts:
            return None
        # Counter.most_common keeps first-seen order among equal counts, as vLLM's sort does.
        rows = [
            (
                str(stat.num_unpadded_tokens),
                str(stat.num_padded_tokens),
                str(stat.num_paddings),
                stat.runtime_mode,
                str(count),
            )
            for stat, count in self._counts.most_common()
        ]
        self._counts = Counter()
        widths = [
            max(len(header), *(len(row[i]) for row in rows))
            for i, header in enumerate(COLUMN_HEADERS)
        ]
        header = _row(COLUMN_HEADERS, widths) + "\n"
        separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|\n"
        lines = "\n".join(_row(row, widths) for row in rows)
        return self.settings_header + header + separator + lines + "\n"


def _row(cells: tuple[str, ...], widths: list[int]) -> str:
    return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
