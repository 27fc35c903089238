"""Stage ``report`` (rule ``report``): ``report.html`` (self-contained, figures embedded), ``report.md`` and the figure PNGs.

Everything is rebuilt from the evaluate jobs' per-request records (:mod:`dflash_eval.report.records`: the tau
tables, the paired comparisons, the histograms and, from the files' job metadata, the drafter notes), the caches'
attributes, the measured target costs and the extra sections (kernel parity, online validation); what the report
holds and how it is rendered: :mod:`dflash_eval.report.build`.
"""

from __future__ import annotations

from pathlib import Path

from dflash_eval.core.errors import atomic_dir, atomic_path
from dflash_eval.report.build import ReportData, build_figures, load_report_data, render_html, render_markdown


def add_arguments(p) -> None:
    p.add_argument("--summary", required=True, help="tau.csv")
    p.add_argument("--evals", nargs="+", required=True,
                   help="the evaluate jobs' records (results/<run>/eval/<ckpt>/<set>.records.parquet; the workflow "
                        "passes these) or their JSONs (<set>.json, made into the same records when read)")
    p.add_argument("--caches", nargs="*", default=[], help="the run's caches (target agreement, provenance)")
    p.add_argument("--prompts-meta", nargs="*", default=[],
                   help="<set>.meta.json files of the prompts stage (what was skipped, per reason)")
    p.add_argument("--extra", nargs="*", default=[], help="extra JSON sections (e.g. kernel parity)")
    p.add_argument("--costs", default=None, help="target_costs.json: adds the estimated decode speedup")
    p.add_argument("--provenance", default=None, metavar="JSON",
                   help="tau.provenance.json (summary): the commit and settings the report shows")
    p.add_argument("--config-sha256", default=None, help="hash of the workflow config, shown under provenance")
    p.add_argument("--out", required=True, help="report.md")
    p.add_argument("--out-html", default=None, help="self-contained report.html (figures embedded)")
    p.add_argument("--figures-dir", default=None, help="folder for the figures as PNG files (Snakemake report)")


def main(args, opts) -> None:
    write_report(args.summary, args.evals, args.caches, args.out, extra=args.extra, costs=args.costs,
                 out_html=args.out_html, figures_dir=args.figures_dir, config_sha256=args.config_sha256,
                 prompts_meta=args.prompts_meta, provenance=args.provenance)


def write_report(summary_csv, evals: list[str], caches: list[str], out, extra: list[str] | None = None,
                 costs=None, out_html=None, figures_dir=None, config_sha256: str | None = None,
                 prompts_meta: list[str] | None = None, provenance=None) -> ReportData:
    """Write ``report.md`` (``out``), and ``report.html`` / the figure PNGs when asked.

    ``evals``: the evaluate jobs' records files or their JSONs (:func:`dflash_eval.report.records.load_offline`).
    ``summary_csv`` is the run's tau.csv (a dependency: the tables are rebuilt from ``evals`` at full
    precision, tau.csv being rounded to 4 decimals). The run name (title) is ``<run>`` of ``results/<run>/report.md``.
    All outputs are written atomically.

    ``provenance``: ``tau.provenance.json`` (the dflash-eval commit and the settings, shown in the report).

    Raises:
        InputError: unreadable inputs (see :func:`load_report_data`).
    """
    folder = Path(out).resolve().parent
    run = folder.name if folder.parent.name == "results" else None
    data = load_report_data(evals, caches, costs=costs, extra=extra, config_sha256=config_sha256, run=run,
                            prompts_meta=prompts_meta, provenance=provenance, summary=summary_csv)
    with atomic_path(out) as tmp:
        tmp.write_text(render_markdown(data))
    if out_html or figures_dir:
        figs = build_figures(data)
        if figures_dir:
            with atomic_dir(figures_dir) as tmp:
                for name, (_, png) in figs.items():
                    (tmp / name).write_bytes(png)
        if out_html:
            with atomic_path(out_html) as tmp:
                tmp.write_text(render_html(data, figs))
    return data

