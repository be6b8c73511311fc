"""Cross-origin requests (CORS), so that a page in a browser can call the API: vLLM's and SGLang's servers allow
every origin by default (`--allowed-origins '["*"]'`), and a web client of theirs (a playground, a chat UI
calling the API from the page) fails here otherwise. vLLM's flags: --allowed-origins, --allowed-methods,
--allowed-headers (JSON lists; "*" allows any) and --allow-credentials.

A browser asks first (a preflight: OPTIONS with `Origin` and `Access-Control-Request-Method`) whether a request
with an API key, a JSON body or an SDK's own headers may be sent; it is answered here, before the API key is
checked (a browser never sends the key with it): 200 with what is allowed, or 400 naming what is not. Every
other answer to a request of an allowed origin (a stream included, its headers set as they go out) carries
`Access-Control-Allow-Origin`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web

ANY = "*"
ANY_JSON = '["*"]'  # each flag's default: anything (vLLM's)
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # what "*" answers a preflight with
MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


@dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...] = (ANY,)
    methods: tuple[str, ...] = (ANY,)
    headers: tuple[str, ...] = (ANY,)
    credentials: bool = False  # Access-Control-Allow-Credentials: cookies and HTTP auth from the browser

    def allows_origin(self, origin: str) -> bool:
        return ANY in self.origins or origin in self.origins

    def _origin_headers(self, origin: str) -> dict[str, str]:
        # "*" cannot go with credentials: the browser then needs the origin itself, and caches must know that
        # the answer varies with it
        if ANY in self.origins and not self.credentials:
            return {"Access-Control-Allow-Origin": ANY}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def preflight(self, request: web.Request) -> web.Response:
        """The answer to a preflight request: 200 with what is allowed, or 400 naming what is not."""
        origin = request.headers["Origin"]
        method = request.headers["Access-Control-Request-Method"].upper()
        asked = [h.strip().lower() for h in request.headers.get("Access-Control-Request-Headers", "").split(",")
                 if h.strip()]
        refused = []
        if not self.allows_origin(origin):
            refused.append("origin")
        if ANY not in self.methods and method not in self.methods:
            refused.append("method")
        allowed_headers = {h.lower() for h in self.headers}
        if ANY not in self.headers and not set(asked) <= allowed_headers:
            refused.append("headers")
        if refused:
            return web.Response(status=400, text=f"Disallowed CORS {', '.join(refused)}",
                                headers={"Vary": "Origin"})
        headers = {**self._origin_headers(origin),
                   "Access-Control-Allow-Methods": ", ".join(ALL_METHODS if ANY in self.methods else self.methods),
                   "Access-Control-Max-Age": str(MAX_AGE_S)}
        if asked or ANY not in self.headers:  # "*": the headers asked for, named back (a browser with
            # credentials does not take a "*")
            headers["Access-Control-Allow-Headers"] = ", ".join(asked if ANY in self.headers else self.headers)
        return web.Response(status=200, text="OK", headers=headers)

    def middleware(self):
        """Preflights answered before anything else (the API key's check included)."""
        @web.middleware
        async def cors(request: web.Request, handler):
            if (request.method == "OPTIONS" and "Origin" in request.headers
                    and "Access-Control-Request-Method" in request.headers):
                return self.preflight(request)
            return await handler(request)
        return cors

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer to an allowed origin says so (aiohttp's on_response_prepare: streams too)."""
        origin = request.headers.get("Origin")
        if origin and self.allows_origin(origin) and "Access-Control-Allow-Origin" not in response.headers:
            for name, value in self._origin_headers(origin).items():
                if name == "Vary" and response.headers.get("Vary"):
                    value = f"{response.headers['Vary']}, {value}"
                response.headers[name] = value


def add_flags(parser) -> None:
    """vLLM's four CORS flags on an argparse parser (the API's process and the launcher that starts it)."""
    parser.add_argument("--allowed-origins", default=ANY_JSON, metavar="JSON",
                        help='the origins of browser pages that may call the OpenAI API (vLLM\'s flag, a JSON list; '
                             '"*": any, the default; [] none)')
    parser.add_argument("--allowed-methods", default=ANY_JSON, metavar="JSON", help="their methods (JSON list)")
    parser.add_argument("--allowed-headers", default=ANY_JSON, metavar="JSON", help="their headers (JSON list)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="their cookies and HTTP authentication (Access-Control-Allow-Credentials)")


def from_args(args) -> CorsPolicy:
    """The policy of parsed flags (add_flags'; ValueError naming the flag)."""
    return policy_from_flags(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def parse_list(text: str, flag: str) -> tuple[str, ...]:
    """A JSON list of strings as vLLM's flags take it (ValueError naming `flag` otherwise)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc}); e.g. '[\"https://app.example.com\"]'") from None
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ValueError(f"{flag}: must be a JSON list of strings, got {text!r}")
    return tuple(value)


def policy_from_flags(origins: str, methods: str, headers: str, credentials: bool) -> CorsPolicy:
    """The policy of vLLM's four flags (JSON lists; ValueError naming the flag)."""
    return CorsPolicy(parse_list(origins, "--allowed-origins"),
                      tuple(m.upper() for m in parse_list(methods, "--allowed-methods")),
                      parse_list(headers, "--allowed-headers"), credentials)
