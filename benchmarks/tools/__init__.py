"""Stand-alone benchmark programs, each with its own command line and results, outside the report."""
