"""Capacity planning: a user's config simulated on pools of hardware (``astraflow plan``).

``pools`` turns a config and ``KIND=GPUS`` pools into a simulated run; ``simulate`` runs it and
reads what it measured; ``search`` finds the pool sizes at which the trainer stops waiting;
``calibrate`` measures this machine's engine and trainer so that a ``local`` pool predicts a
real run; ``planner`` puts them together; ``report`` prints the result; ``cli`` is the command.
``docs/sim.md``, section "Capacity planning".
"""
