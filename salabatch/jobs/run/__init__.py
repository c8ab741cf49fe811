"""A job run: its rows planned (`plan`; request lines in `openai_batch`), what the run prepares
before its model loads (`prepare`), the rows answered with one loaded model (`answerer`), the
local executor that writes them (`runner`), and `--dry-run` (`dry_run`)."""
