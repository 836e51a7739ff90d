"""Single-turn and tool-using task environments: the demo's arithmetic, Countdown and Reverse (`tasks`)
and the calculator task `multiply` (a `tidal.core.toolenv.ToolEnvironment`)."""
