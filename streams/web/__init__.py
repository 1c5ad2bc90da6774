"""The worker's HTTP surface: the JSON API and its routes (`api`), the read queries the
API, the dashboard and the CLI share (`queries`), and the dashboard's assets
(`dashboard/`)."""
