"""The web console under /ui, in one place: its front door and its pages.

- `door`: an API key exchanged for a session cookie, the session and CSRF checks, the CSP,
  and the middleware that puts the console's routes behind them (`setup_console`);
- `routes`: the pages and endpoints (static assets, session, admin actions, the playground);
- `live`: the one server-sent event stream of figures the pages draw;
- `sessions`: the session store, bounded per key;
- `keys`: the keys page's writes to the keys file;
- `static/`: the page, script, style sheet and icon, served as they are (no build step).
"""
