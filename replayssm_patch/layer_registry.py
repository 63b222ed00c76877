"""What each GDN layer built in this process decodes with: "ring" or "native: <reason>"."""

layer_report: dict[str, str] = {}
