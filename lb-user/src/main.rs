fn main() -> anyhow::Result<()> {
    let _ebpf = lb_user::datapath::load()?;
    Ok(())
}
