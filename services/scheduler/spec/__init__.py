"""The job spec: its YAML read safely (`loader`), its fields and bounds (`fields`),
parsed and checked (`parse`), and parsed specs remembered (`cache`)."""
