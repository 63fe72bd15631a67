"""A discrete-event simulation of an RL pipeline at cluster scale, driving the project's own scheduler.

Only compute is modelled (the step costs of `sfhpc.sim.cost_model`); the rank table, the assignment of
episodes by load, lending and reclaiming are `sfhpc.rl.scheduler.Scheduler`'s, called as the controller
calls them. Modules: `clock` (the event queue), `engine` (an engine's continuous batch), `workload`
(long-tailed episodes), `cluster` (a tag map scaled to a GPU count, as a launch plan), `pipeline` (the
controller's loop per mode and the figures it measures).
"""
