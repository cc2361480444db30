"""The papers' claims in simulation, one module per experiment (lab/experiments.py names them; tools/exp_*.py
are their command lines). Each has its Options (the command line's flags, as given), TINY (the smoke test's
set-up) and run(options), which prints its tables and writes its JSON and plots to options.out."""
