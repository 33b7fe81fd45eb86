"""`python -m vit_hub.demo`: the app of an installed package, with app.py's flags (app.py in a
checkout or a Space starts the same)."""

from vit_hub.demo.server import main

main(prog="python -m vit_hub.demo")
