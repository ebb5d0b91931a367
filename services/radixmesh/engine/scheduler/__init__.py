"""The scheduler: `core.Scheduler` composes prefill admission (`prefill`), decode (`decode`) and result processing
(`results`); optional features plug in through hooks (`hooks`). `loop` is the scheduler process's message loop and
`process` its entry point (imported by the front end: this package imports nothing at its top)."""
