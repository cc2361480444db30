"""The papers' claims in simulation, one module per experiment (lab/experiments.py names them; `python -m
jaxserve.lab NAME` is their command line). Each has its Options (the command line's flags) with HELP (and CHOICES
where an option takes one of a few values), TINY (the smoke test's set-up) and run(options), which prints its
tables and writes its JSON and plots to options.out."""
