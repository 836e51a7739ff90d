"""Multi-turn episodes, the rollout worker's side (`multiturn`, `renderers`) and the environment processes
that step them (`pool` in the worker, `process` for each environment process, `checks` on what they return)."""
