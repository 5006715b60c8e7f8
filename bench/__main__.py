def main(argv=None):
    raise SystemExit("not yet")


if __name__ == "__main__":
    main()
