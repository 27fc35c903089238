"""The tau table and the run's report (markdown, HTML, figures)."""
