"""What the studies in experiments/ share and the library never imports: workloads (synthetic
and the Mooncake trace), text data, scoring, and the run records every study writes."""
