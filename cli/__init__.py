"""`meshkeeper`, the command line: a client of the controller's REST API (services/client.py)
and the local stack behind `meshkeeper up` and `meshkeeper demo`. Nothing in the controller
or the worker imports it (docs/architecture.md, "Layout")."""
