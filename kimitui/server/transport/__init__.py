"""The server's transport: the listening socket and uvicorn's thread (``background``), the deadline for a
request's head (``read_timeout``), and the requests refused before any route runs (``guard``)."""
