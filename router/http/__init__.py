"""The web front: TGI's and OpenAI's HTTP API on top of the serving engine (pytgi_router.core):
parsing and validating bodies, streaming answers, /info, /metrics, the docs."""
