"""The elastic driver: world changes and recoveries inside a running fit, over the ``elastic`` protocol.

Beside the protocol (``elastic/``: the job's store, sessions, worlds; no Lightning, no megatron) the
driver does the training side of each change on the run (``runtime.training_run.TrainingRun``) and
reaches the loop only through ``front.TrainingFront``:

- ``driver``: ``ElasticDriver`` (entering, every step boundary, leaving); ``options``: ``ElasticOptions``,
  what every front end takes (``OnNodeChange``'s, Fabric's ``elastic=``), which makes the driver;
  ``leave_notice``: a leave signal (SIGTERM, SIGUSR1) marks the process to leave at the next boundary;
- ``world_change``: one change at its boundary (a leaver's hand-off, a grow's switch, a shrink's);
- ``joining``: a joiner's side of a grow; ``ahead_change``: a change's target built in the background;
- ``recovery``: the one recovery guard and its table of ways back, and what every front end runs
  under it (a step, a layout switch, a rollout phase); ``rebuild``: the survivors rebuild
  the state in a world of their own; ``snapshots``, ``step_log``: in-memory snapshots and the steps
  since, for state no survivor holds;
- ``layout_policy``: the layout of a world of a new size; ``change_report``: what a change cost;
- ``front``: what the driver needs of the front end (``TrainingFront``, ``Launch``, ``ElasticCallback``).
"""
