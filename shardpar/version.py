"""The version of shardpar: the package face re-exports it, and every manifest records it
(``shardpar_version``), so it lives below both."""

__version__ = "0.1.0"
