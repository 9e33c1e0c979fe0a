"""Reports: see a simulated (and, once the runtime lands, measured) training step.

``tierflow report TRACE --hardware H --policies a,b -o report.html [--png DIR]`` writes
one self-contained HTML page (figures embedded, no network) and optionally the same
figures as PNG files. From Python::

    from tierflow.report import write_report
    write_report("report.html", trace, hw, results, png_dir="figs")

matplotlib is imported only when a figure is drawn, so importing this package is cheap.
"""

from .analysis import Breakdown, breakdown
from .downsample import downsample_steps, merge_intervals, minmax_indices
from .html import build_figures, build_report, write_pngs, write_report
from .measured import Measured
from .verdict import verdict

__all__ = [
    "Breakdown",
    "Measured",
    "breakdown",
    "build_figures",
    "build_report",
    "downsample_steps",
    "merge_intervals",
    "minmax_indices",
    "verdict",
    "write_pngs",
    "write_report",
]
