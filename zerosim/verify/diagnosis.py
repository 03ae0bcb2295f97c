def diagnose(records, contracts):
    return []
