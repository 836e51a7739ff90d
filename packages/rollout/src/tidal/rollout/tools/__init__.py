"""Tools an episode may call (plugin kind ``tool``) and the parsers that find calls in the model's text
(plugin kind ``tool_parser``).

- `calculator` (`tools.calculator`): arithmetic through an AST walker (never `eval`), bounded.
- `python` (`tools.python`): code in a bubblewrap sandbox (`tools.bwrap`; limits on the whole call by a
  cgroup, `tools.cgroups`, else rlimits; wall timeout, output cap, no network).
- `tags` and `json` (`tidal.core.toolparsers`, in tidal-core beside the base `tidal.core.toolenv`, so an
  environment outside Tidal can use them): ``<calc>1+2</calc>`` for the tiny char model; Hermes/Qwen's
  ``<tool_call>{...}</tool_call>`` for real chat models.

Tools run in the environment process that steps the episode (`tidal.core.toolenv`), never in the
rollout worker. None of these modules imports torch.
"""
