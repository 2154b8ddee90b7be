"""Layer 6, analysis: everything that reads results records: paired statistics (`stats`), the CI
regression gate (`regress`), the concurrency simulation (`simulate`) and the HTML / PDF `report`."""
