"""Report writers: JSON (the source of truth), Markdown, HTML, JUnit."""
