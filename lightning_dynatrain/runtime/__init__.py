"""The training core: one run's megatron training and its layout switches, without Lightning.

Every front end (the Lightning strategy, the Fabric and Accelerate loop engine) is a thin layer over
these, so a run is set up, checked, stepped and switched the same way under each:

- ``settings``: ``DynaTrainSettings``, the one settings type every edge parses into (the strategy's
  arguments, Fabric's strategy, Accelerate's plugin, ``DYNATRAIN_*`` variables, a YAML block);
- ``recipe``: ``MegatronRecipe`` (the layout-free model and batch sizes) and ``AdamSettings``;
- ``layout_checks``: the rules a layout must pass against the world, the model, the batch and the
  optimizer, each error naming the rule and a fix;
- ``training_state`` / ``steps``: building a layout's megatron state; one training or evaluation step;
- ``training_run``: ``TrainingRun``, the run at its current layout (set-up, the one check of a switch
  request, the switch, the steps, the install of every new state);
- ``switcher``: ``LayoutSwitcher``, what a run's switches share (made by ``LayoutSwitcher.from_settings``);
- ``switch_schedule``: ``SwitchSchedule``, the driver of a schedule of switches;
- ``reconfig_report``: ``ReconfigReport``, the job's figures of one switch;
- ``world_topology``, ``step_clock``, ``threads``: the nodes of a world, how a background build slowed
  the steps beside it, the intra-op threads a process may use.

Importing this package imports nothing of it (megatron-core loads with the modules that need it).
"""
