"""`python -m tools.view STORE`: a browser viewer of a block store that pages only what it sees,
and headless renders and block maps of it (see docs/view.md)."""
