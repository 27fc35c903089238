"""Stage ``report`` (rule ``report``): ``report.html`` (self-contained, figures embedded), ``report.md`` and the figure PNGs.

Everything is rebuilt from the evaluate JSONs, the caches' attributes, the measured target costs
and the extra sections (kernel parity, online validation); what the report holds and how it is
rendered: :mod:`dflash_eval.report.build`.
"""

from __future__ import annotations

from pathlib import Path

from dflash_eval.core.errors import InputError, atomic_dir, atomic_path
from dflash_eval.output_digests import record_outputs
from dflash_eval.report.build import ReportData, build_figures, load_report_data, render_html, render_markdown


def add_arguments(p) -> None:
    p.add_argument("--summary", required=True, help="tau.csv")
    p.add_argument("--evals", nargs="+", required=True, help="evaluate outputs")
    p.add_argument("--caches", nargs="*", default=[], help="the run's caches (target agreement, provenance)")
    p.add_argument("--prompts-meta", nargs="*", default=[],
                   help="<set>.meta.json files of the prompts stage (what was skipped, per reason)")
    p.add_argument("--extra", nargs="*", default=[], help="extra JSON sections (e.g. kernel parity)")
    p.add_argument("--costs", default=None, help="target_costs.json: adds the estimated decode speedup")
    p.add_argument("--run-settings", nargs="*", default=None, metavar="JSON",
                   help="the run's options records of its run-level stages (results/<run>/options/<stage>/run.json): "
                        "target_costs.json and each --extra section must name their stage's (settings_sha256), else "
                        "they are refused (another run's file copied in place)")
    p.add_argument("--config-sha256", default=None, help="hash of the workflow config, shown under provenance")
    p.add_argument("--out", required=True, help="report.md")
    p.add_argument("--out-html", default=None, help="self-contained report.html (figures embedded)")
    p.add_argument("--figures-dir", default=None, help="folder for the figures as PNG files (Snakemake report)")


def main(args, opts) -> None:
    write_report(args.summary, args.evals, args.caches, args.out, extra=args.extra, costs=args.costs,
                 out_html=args.out_html, figures_dir=args.figures_dir, config_sha256=args.config_sha256,
                 prompts_meta=args.prompts_meta, run_records=args.run_settings)


def write_report(summary_csv, evals: list[str], caches: list[str], out, extra: list[str] | None = None,
                 costs=None, out_html=None, figures_dir=None, config_sha256: str | None = None,
                 prompts_meta: list[str] | None = None, run_records: list[str] | None = None) -> ReportData:
    """Write ``report.md`` (``out``), and ``report.html`` / the figure PNGs when asked.

    ``summary_csv`` is the run's tau.csv (a dependency: the tables are rebuilt from ``evals`` at full
    precision, tau.csv being rounded to 4 decimals). The run name (title) is ``<run>`` of ``results/<run>/report.md``.
    All outputs are written atomically.

    Raises:
        InputError: unreadable inputs (see :func:`load_report_data`); a tau.csv that disagrees with ``evals``
            (:func:`check_summary`).
    """
    folder = Path(out).resolve().parent
    run = folder.name if folder.parent.name == "results" else None
    data = load_report_data(evals, caches, costs=costs, extra=extra, config_sha256=config_sha256, run=run,
                            prompts_meta=prompts_meta, run_records=run_records)
    check_summary(summary_csv, data.table)
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
    record_outputs("report", [out, out_html, figures_dir], made_from=[*evals, *(extra or []), costs])  # compared at parse time (an edited or foreign copy is remade)
    return data


def check_summary(summary_csv, table) -> None:
    """Refuse a ``tau.csv`` that is not what ``summary`` makes of the run's evaluate outputs and target costs:
    ``table`` is that (the report's full table, :attr:`dflash_eval.report.build.ReportData.table`), compared cell by
    cell (:func:`dflash_eval.report.tau_table.check_table`). The report is rebuilt from the evaluate outputs, so a
    hand-edited (or stale) tau.csv used to disagree with it without a word (the fifth trial's F5; the tenth's F4 for
    the columns but tau). ``summary_csv`` None: not compared.

    Raises:
        InputError: ``(tau.csv, <column> | "rows" | "columns", ...)`` naming the row and both values.
    """
    if summary_csv is None:
        return
    from dflash_eval.report.tau_table import check_table

    try:
        text = Path(summary_csv).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(summary_csv, None, f"not a readable tau table ({err})",
                         f"rebuild it from the evaluate outputs: snakemake --forcerun {summary_csv}") from None
    check_table(text, summary_csv, table)
