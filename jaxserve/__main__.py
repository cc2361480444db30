from jaxserve.cli import run

run()
