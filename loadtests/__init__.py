"""The serving benchmark client, workloads and plots (see the loadtests issue)."""
